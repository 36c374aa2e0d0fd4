"""Head-adaptive budgets (AdaKV, CriticalAdaKV): the allocation on hand-made scores, ragged storage (each
head's own slots, attended per head) against attention over full KV with the evicted keys masked per
head, and what the planner and ``kv_cache_bytes`` report."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from eval.runner import kv_cache_bytes
from snapkv.head_budgets import adakv_keep, authors_keep, pack
from snapkv.memory import plan
from snapkv.ragged import RaggedLayer
from tiny_models import tiny_model


def test_adakv_moves_budget_to_the_heads_with_the_highest_scores_above_a_safeguard():
    scores = torch.tensor([[[9., 8., 7., 6., 5., 4.], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]])
    keep = adakv_keep(scores.clone(), 3, alpha=0.0)  # 6 of 12 across both heads: all of head 0
    assert keep[0, 0].tolist() == [True] * 6 and not keep[0, 1].any()
    keep = adakv_keep(scores.clone(), 3, alpha=0.5)  # each head keeps int(3 * 0.5) = 1 at least
    assert keep[0, 1].tolist() == [False] * 5 + [True] and keep[0, 0].sum() == 5
    kept, valid = pack(keep)
    assert kept.shape == (1, 2, 5) and valid.sum(-1).tolist() == [[5, 1]]
    assert kept[0, 0].tolist() == [0, 1, 2, 3, 4] and kept[0, 1, 0] == 5


def test_the_authors_allocation_scales_each_heads_share_above_its_floor():
    scores = torch.tensor([[[9., 8., 7., 6., 5., 4.], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]])
    # n_past 3: the global top 6 are all head 0's (c = [6, 0]); floor int(0.5 * 3) = 1;
    # caps round(6 * 0.5 + 1) = 4 and round(0 * 0.5 + 1) = 1
    keep = authors_keep(scores, 3, alpha=0.5)
    assert keep[0, 0].tolist() == [True] * 4 + [False] * 2 and keep[0, 1].tolist() == [False] * 5 + [True]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", [snapkv.AdaKV(budget=40, window=8), snapkv.CriticalAdaKV(budget=40, window=8),
                                    snapkv.AdaKV(budget=40, window=8, allocation="authors"),
                                    snapkv.AdaKV(budget=40, window=8, scorer="knorm")])
def test_a_head_adaptive_cache_decodes_as_attention_over_each_heads_kept_keys(attn, method):
    """Stored ragged (each head's own slots, nothing padded): every step's logits equal attention over the
    full cache with every evicted key masked per head, as kvpress runs it."""
    model = tiny_model("llama-gqa", attn=attn)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    forced = [5, 17, 99, 3] * 5  # past the first room of 16 tokens a head: its doubling is decoded through
    with snapkv.compress(model, method) as session, torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        kept = snapkv.kept_positions(cache)
        stored = [(type(layer), layer.keys.shape[1]) for layer in cache.layers]
        ours = [model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1] for t in forced]
    assert session.cache_lengths == [40] * 3
    counts = [[len(h) for h in layer[0]] for layer in kept]
    rounding = 2 if getattr(method, "allocation", "kvpress") == "authors" else 0  # the authors' round() per head
    assert any(len(set(c)) > 1 for c in counts) and all(abs(sum(c) - 2 * 40) <= rounding for c in counts)
    assert stored == [(RaggedLayer, sum(c)) for c in counts]
    # the reference: full KV, each head's evicted keys masked in every layer
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full, use_cache=True)
        reference = []
        for step, token in enumerate(forced):
            masks = []
            for layer in kept:
                visible = torch.zeros(2, 160 + step + 1, dtype=torch.bool)
                for head, positions in enumerate(layer[0]):
                    visible[head, positions] = True
                visible[:, 160:] = True
                masks.append(visible.repeat_interleave(2, dim=0))
            reference.append(_masked_step(model, full, token, 160 + step, masks))
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_folded_path_of_accelerators_equals_the_per_head_path(monkeypatch, attn):
    """One product per row over its whole buffer with the other heads' slots masked (taken on an
    accelerator) gives the logits of one attention call per head (a CPU's), over a left-padded batch
    whose rows keep different totals, past a doubling of the room."""
    from snapkv import ragged
    model = tiny_model("llama-gqa", attn=attn)
    rows = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (150, 30)]
    ids = torch.zeros(2, 150, dtype=torch.long)
    mask = torch.zeros(2, 150, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 150 - len(r):], mask[i, 150 - len(r):] = r, 1
    steps = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))

    def decode():
        with snapkv.compress(model, snapkv.AdaKV(budget=40, window=8)), torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache)
            totals = {tuple(sum(c) for c in layer.prompt_counts) for layer in cache.layers}
            return torch.stack([model(steps[:, t:t + 1], cache=cache).logits[:, -1] for t in range(20)]), totals
    per_head, totals = decode()
    assert any(len(set(t)) > 1 for t in totals)  # the shorter row keeps fewer slots: unused ones at its end
    monkeypatch.setattr(ragged, "folds", lambda query: query.shape[2] == 1)
    folded, _ = decode()
    torch.testing.assert_close(folded, per_head, rtol=1e-5, atol=1e-5)


def test_a_ragged_layer_selects_and_repeats_rows_with_their_segments():
    counts = torch.tensor([[2, 1], [1, 3]])
    keys = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)
    layer = RaggedLayer(keys, keys.clone(), counts, torch.tensor([[5, 9, 2, 0], [7, 1, 4, 8]], dtype=torch.int32))
    layer.update(torch.full((2, 2, 1, 1), -1.0), torch.full((2, 2, 1, 1), -1.0))
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.prompt_counts == [[1, 3]] and [p.tolist() for p in layer.kept_positions()[0]] == [[7], [1, 4, 8]]
    assert [layer.keys[0, s:e, 0].tolist() for s, e in (layer.segment(0, 0), layer.segment(0, 1))] == \
        [[4.0, -1.0], [5.0, 6.0, 7.0, -1.0]]
    layer.batch_repeat_interleave(2)
    assert layer.prompt_counts == [[1, 3]] * 2 and torch.equal(layer.keys[0], layer.keys[1])


def _masked_step(model, cache, token, position, masks):
    """One decoding step over ``cache`` with a per-layer, per-query-head mask of visible keys."""
    return _masked_pass(model, cache, [token], position, [m[:, None, :] for m in masks])[-1]


def _masked_pass(model, cache, tokens, position, masks):
    """``tokens`` at ``position...`` over ``cache`` with per-layer masks ``[heads, q, keys]`` of visible keys;
    the logits of every new token."""
    handles = []
    for layer, visible in zip(model.model.layers, masks):
        def before(module, args, kwargs, visible=visible):
            lowest = torch.finfo(torch.float32).min
            blocked = torch.zeros(visible.shape, dtype=torch.float32).masked_fill(~visible, lowest)
            kwargs["attention_mask"] = blocked[None]
            return args, kwargs
        handles.append(layer.self_attn.register_forward_pre_hook(before, with_kwargs=True))
    positions = torch.arange(position, position + len(tokens))[None]
    try:
        out = model(torch.tensor([tokens]), cache=cache, use_cache=True, position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    return out.logits[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", [snapkv.AdaKV(budget=40, window=8), snapkv.KVzip(budget=40)])
def test_a_question_turn_after_a_head_adaptive_cut_attends_per_head(attn, method):
    """query_aware=false: the question's tokens, appended after the cut in one pass, see each head's kept
    keys and each other causally, as over the full cache with the evicted keys masked per head."""
    model = tiny_model("llama-gqa", attn=attn)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(7))
    question = [11, 22, 33, 44, 55]
    with snapkv.compress(model, method), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        kept = snapkv.kept_positions(cache)
        ours = model(torch.tensor([question]), cache=cache, use_cache=True).logits[0]
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full, use_cache=True)
        masks = []
        for layer in kept:
            visible = torch.zeros(2, len(question), 160 + len(question), dtype=torch.bool)
            for head, positions in enumerate(layer[0]):
                visible[head, :, positions] = True
            visible[:, :, 160:] = torch.ones(len(question), len(question), dtype=torch.bool).tril()
            masks.append(visible.repeat_interleave(2, dim=0))
        reference = _masked_pass(model, full, question, 160, masks)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_a_later_turn_is_not_compressed_on_a_head_adaptive_cache():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(7))
    with snapkv.compress(model, snapkv.AdaKV(budget=40, window=8), compress_later_turns=True), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        with pytest.raises(snapkv.InputError, match="head-adaptive cache cannot compress a later turn"):
            model(torch.randint(0, 128, (1, 20)), cache=cache, use_cache=True)


def test_kv_cache_bytes_and_the_plan_count_what_a_head_adaptive_cache_stores():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    cfg = snapkv.AdaKV(budget=40, window=8)
    with snapkv.compress(model, cfg), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        assert [layer.keys.shape[1] for layer in cache.layers] == [2 * 40] * 3  # 2 KV heads x 40 a head
        assert kv_cache_bytes(cache) == 3 * 2 * 40 * 2 * 16 * 4  # 3 layers, K and V, head_dim 16, float32
        assert plan(model.config, 160, cfg, dtype="float32")["kv_cache_bytes"] == kv_cache_bytes(cache)
        # what the layers would hold padded to their longest head
        assert sum(layer.padded_bytes() for layer in cache.layers) > kv_cache_bytes(cache)
        prompt_bytes = kv_cache_bytes(cache)
        for token in (5, 6):  # appended to every head, into room for 16 tokens a head
            model(torch.tensor([[token]]), cache=cache, use_cache=True)
    assert kv_cache_bytes(cache) - prompt_bytes == 3 * 2 * 16 * 2 * 16 * 4


def test_head_adaptive_refusals_are_one_line():
    with pytest.raises(snapkv.InputError, match="gqa='repeat' is not allowed"):
        snapkv.AdaKV(gqa="repeat")
    with pytest.raises(snapkv.InputError, match="scorer='pyramidkv' is not allowed"):
        snapkv.AdaKV(scorer="pyramidkv")
    with pytest.raises(snapkv.InputError, match=r"alpha_safeguard=1.5 must be a number in \[0, 1\]"):
        snapkv.CriticalAdaKV(alpha_safeguard=1.5)
    with pytest.raises(snapkv.InputError, match="allocation='paper' is not allowed"):
        snapkv.AdaKV(allocation="paper")
