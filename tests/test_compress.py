"""snapkv.compress on tiny random transformers models: shapes, positions, padding, detaching."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from snapkv.ragged import RaggedLayer
from method_settings import RUNNABLE, small
from tiny_models import ARCHITECTURES, tiny_model

# every registered compressing method that runs from its defaults (``RUNNABLE``), at a test size, and one variant
# (average pooling, a selection per query head)
METHODS = {name: small(name) for name in RUNNABLE}
METHODS["snapkv-avg-repeat"] = snapkv.SnapKV(budget=48, window=8, kernel=3, pooling="avgpool", gqa="repeat")


def prefill(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=True, cache=DynamicCache(config=model.config), **kw)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_cache_length_per_layer_after_prefill(arch, method):
    model = tiny_model(arch)
    cfg = METHODS[method]
    ids = torch.randint(0, 128, (1, 150))
    with snapkv.compress(model, cfg) as session:
        out = prefill(model, ids)
        n = model.config.num_hidden_layers
        expected = [min(150, cfg.layer_budget(i, n, 150)) for i in range(n)]
        heads = model.config.num_attention_heads if cfg.gqa == "repeat" else model.config.num_key_value_heads
        kept = snapkv.kept_positions(out.cache)
        stored = [slots_held(l) for l in out.cache.layers]
        if cfg.scores_after_prefill:  # KVzip: budgets across layers, each layer its own total
            counts = [sum(len(p) for p in layer[0]) for layer in kept]
            assert sum(counts) == n * heads * cfg.budget_for(150) and len(set(counts)) > 1
            expected = [c // heads for c in counts]
        assert session.cache_lengths == expected
        for layer, length, positions in zip(out.cache.layers, expected, kept):
            counts = [len(p) for p in positions[0]]
            assert getattr(layer, "kv_heads", layer.keys.shape[1]) == heads == len(counts)
            if not cfg.scores_after_prefill:  # head-adaptive: the same total, per head its own count
                assert sum(counts) == heads * length
            assert slots_held(layer) == sum(counts)  # a head-adaptive layer: no padding to its longest head
            assert all(len(set(p.tolist())) == len(p) and p.max() < 150 for p in positions[0])
        step = model(ids[:, -1:], cache=out.cache, use_cache=True)
        assert torch.isfinite(step.logits).all()
        assert [slots_held(l) for l in out.cache.layers] == [s + heads for s in stored]


def slots_held(layer) -> int:
    """Key slots a layer holds over all its heads (a ragged layer: each head's prompt slots and the tokens
    appended to every head since)."""
    if isinstance(layer, RaggedLayer):
        return sum(end - start for row in range(layer.keys.shape[0])
                   for start, end in (layer.segment(row, head) for head in range(layer.kv_heads)))
    return layer.keys.shape[1] * layer.keys.shape[2]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_with_compression(attn):
    model = tiny_model("llama-gqa", attn=attn)
    ids = torch.randint(0, 128, (1, 120))
    with snapkv.compress(model, METHODS["snapkv"]) as session:
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert session.cache_lengths == [48] * 3
    assert out.shape == (1, 126)


def test_prompt_shorter_than_budget_is_untouched():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 40))
    full = prefill(model, ids)
    with snapkv.compress(model, METHODS["snapkv"]) as session:
        comp = prefill(model, ids)
        assert session.cache_lengths == [40] * 3
    for a, b in zip(full.cache.layers, comp.cache.layers):
        assert torch.equal(a.keys, b.keys)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_budget_at_least_length_gives_full_kv_logits(method):
    model = tiny_model("llama-gqa")
    cfg = METHODS[method]
    if cfg.stores_key_channels:  # every token kept, fewer key channels: tests/test_think.py
        pytest.skip("keeps every token but not every key channel")
    shortest = min(cfg.layer_budget(i, 3, 10**6) for i in range(3)) if cfg.compresses else 64
    if cfg.scores_after_prefill:  # nothing is cut during KVzip's prefill: its budget is its average
        shortest = cfg.budget
    ids = torch.randint(0, 128, (1, shortest))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with snapkv.compress(model, cfg):
        got = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(torch.stack(ref.logits), torch.stack(got.logits))


def test_decoding_keeps_absolute_positions():
    """The first generated token sits at position L, not at the compressed cache length."""
    model = tiny_model("llama-gqa")
    length, cfg = 150, METHODS["streamingllm"]
    ids = torch.randint(0, 128, (1, length))
    nxt = torch.randint(0, 128, (1, 1))
    full = prefill(model, ids)
    keep = torch.cat([torch.arange(4), torch.arange(length - 44, length)])
    for layer in full.cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    with torch.no_grad():
        at_l = model(nxt, cache=full.cache, position_ids=torch.tensor([[length]])).logits
    with snapkv.compress(model, cfg):
        comp = prefill(model, ids)
        with torch.no_grad():
            got = model(nxt, cache=comp.cache).logits
    torch.testing.assert_close(got, at_l, rtol=1e-5, atol=1e-5)
    for layer in full.cache.layers:
        layer.crop(-1)
    with torch.no_grad():
        restarted = model(nxt, cache=full.cache, position_ids=torch.tensor([[48]])).logits
    assert not torch.allclose(got, restarted, atol=1e-3), "positions restarting at the cache length must differ"


# PyramidKV's per-layer budgets refuse padding; random draws per batch row, so a row's draw depends on the batch
@pytest.mark.parametrize("method", sorted(set(METHODS) - {"pyramidkv", "random", "kvzip"}))
def test_left_padded_batch_equals_unbatched(method):
    model = tiny_model("llama-gqa")
    cfg = METHODS[method]
    torch.manual_seed(5)
    rows = [torch.randint(1, 128, (n,)) for n in (130, 90, 40)]  # the last is shorter than the budget
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = torch.randint(1, 128, (len(rows), 3))

    def decode(input_ids, attention_mask=None, position_ids=None):
        out = prefill(model, input_ids, attention_mask=attention_mask, position_ids=position_ids)
        logits = [out.logits[:, -1]]
        for t in range(steps.shape[1]):
            with torch.no_grad():
                logits.append(model(steps[: input_ids.shape[0], t:t + 1] if input_ids.shape[0] > 1 else
                                    steps[row, t:t + 1][None], cache=out.cache).logits[:, -1])
        return torch.stack(logits, 1)

    with snapkv.compress(model, cfg):
        batched = decode(ids, mask, positions)
        for row, r in enumerate(rows):
            single = decode(r[None])
            torch.testing.assert_close(batched[row], single[0], rtol=1e-4, atol=1e-4)


def test_detach_restores_the_model():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 100))
    before = model.generate(ids, max_new_tokens=4, do_sample=False)
    groups = [l.self_attn.num_key_value_groups for l in model.model.layers]
    with snapkv.compress(model, METHODS["snapkv-avg-repeat"]):
        model.generate(ids, max_new_tokens=4, do_sample=False)
    assert [l.self_attn.num_key_value_groups for l in model.model.layers] == groups
    assert not any(l.self_attn._forward_hooks or l.self_attn._forward_pre_hooks for l in model.model.layers)
    assert not model.model._forward_pre_hooks
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), before)


def test_unsupported_model_is_an_error():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="not supported.*llama"):
        snapkv.compress(model, METHODS["snapkv"]).__enter__()


def test_budget_larger_than_context_is_an_error():
    model = tiny_model("llama-gqa", max_position_embeddings=256)
    with pytest.raises(ValueError, match="budget=512.*max_position_embeddings=256"):
        snapkv.compress(model, snapkv.SnapKV(budget=512)).__enter__()


def test_a_ratio_compresses_each_prompt_to_its_fraction():
    model = tiny_model("llama-gqa")
    cfg = snapkv.SnapKV(budget=None, ratio=0.6, window=8)
    for n in (100, 151):
        ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
        with snapkv.compress(model, cfg) as session, torch.no_grad():
            model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        assert session.cache_lengths == [int(n * 0.4)] * model.config.num_hidden_layers
