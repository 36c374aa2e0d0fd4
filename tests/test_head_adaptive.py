"""Head-adaptive budgets (AdaKV, CriticalAdaKV): the allocation on hand-made scores, storage per head
with padding never attended to, and what the planner and ``kv_cache_bytes`` report."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from eval.runner import kv_cache_bytes
from snapkv.head_budgets import adakv_keep, authors_keep, pack
from snapkv.memory import plan
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
    """Stored per head (padded to the longest head, the padding never attended to): every step's logits
    equal attention over the full cache with every evicted key masked per head, as kvpress runs it."""
    model = tiny_model("llama-gqa", attn=attn)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    forced = [5, 17, 99, 3]
    with snapkv.compress(model, method) as session, torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        kept = snapkv.kept_positions(cache)
        stored = [layer.keys.shape[2] for layer in cache.layers]
        ours = [model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1] for t in forced]
    assert session.cache_lengths == [40] * 3
    counts = [[len(h) for h in layer[0]] for layer in kept]
    rounding = 2 if getattr(method, "allocation", "kvpress") == "authors" else 0  # the authors' round() per head
    assert any(len(set(c)) > 1 for c in counts) and all(abs(sum(c) - 2 * 40) <= rounding for c in counts)
    assert stored == [max(c) for c in counts]
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
    stored = sum(layer.keys.shape[2] for layer in cache.layers)
    assert kv_cache_bytes(cache) == stored * 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    planned = plan(model.config, 160, cfg, dtype="float32")["kv_cache_bytes"]
    bound = 3 * min(160, 2 * 40 - int(40 * 0.2)) * 2 * 2 * 16 * 4
    assert kv_cache_bytes(cache) <= planned == bound


def test_head_adaptive_refusals_are_one_line():
    with pytest.raises(snapkv.InputError, match="gqa='repeat' is not allowed"):
        snapkv.AdaKV(gqa="repeat")
    with pytest.raises(snapkv.InputError, match="scorer='pyramidkv' is not allowed"):
        snapkv.AdaKV(scorer="pyramidkv")
    with pytest.raises(snapkv.InputError, match=r"alpha_safeguard=1.5 must be a number in \[0, 1\]"):
        snapkv.CriticalAdaKV(alpha_safeguard=1.5)
    with pytest.raises(snapkv.InputError, match="allocation='paper' is not allowed"):
        snapkv.AdaKV(allocation="paper")
