"""Several settings, one prefill: each cache equals its solo run, tensor for tensor."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from method_settings import with_every_method
import snapkv.methods.h2o as h2o_module
import snapkv.observation_window as snapkv_module
from tiny_models import tiny_model

SETTINGS = with_every_method([
    snapkv.SnapKV(budget=48, window=8, kernel=5),
    snapkv.FullKV(),
    snapkv.SnapKV(budget=64, window=8, kernel=5),
    snapkv.SnapKV(budget=48, window=8, kernel=3, pooling="avgpool"),
    snapkv.SnapKV(budget=48, window=8, kernel=5, gqa="repeat"),
    snapkv.PyramidKV(budget=48, window=8, kernel=5),
    snapkv.H2O(budget=48, window=8),
    snapkv.H2O(budget=64, window=8),
    snapkv.StreamingLLM(budget=48, sink_tokens=4),
    snapkv.RandomKeep(budget=48, window=8),
])


def decode(model, cache, first_logits, steps=5, attention_mask=None):
    """Greedy tokens and logits from a prefilled cache."""
    logits, out = first_logits, []
    for _ in range(steps):
        token = logits.argmax(-1)
        out.append(logits)
        logits = model(token[:, None], cache=cache, use_cache=True).logits[:, -1]
    return torch.stack(out, 1)


def solo(model, cfg, ids, **kw):
    with snapkv.compress(model, cfg) as session, torch.no_grad():
        cache = DynamicCache(config=model.config)
        first = model(ids, cache=cache, use_cache=True, **kw).logits[:, -1]
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        return layers, session.cache_lengths, decode(model, cache, first)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3"])
def test_every_cache_equals_its_solo_run(attn, arch):
    model = tiny_model(arch, attn=attn)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    with snapkv.compress(model, SETTINGS) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
        caches = session.caches
        lengths = session.lengths_per_setting
        shared = [([(l.keys.clone(), l.values.clone()) for l in cache.layers], decode(model, cache, first))
                  for cache in caches]
    assert len(caches) == len(SETTINGS)
    for cfg, (layers, logits), cache_lengths in zip(SETTINGS, shared, lengths):
        solo_layers, solo_lengths, solo_logits = solo(model, cfg, ids)
        assert cache_lengths == solo_lengths, cfg.label()
        for (k, v), (sk, sv) in zip(layers, solo_layers):
            assert torch.equal(k, sk) and torch.equal(v, sv), cfg.label()
        assert torch.equal(logits, solo_logits), cfg.label()


def test_left_padded_batch_shares_the_prefill():
    model = tiny_model("llama-gqa")
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 128, (n,), generator=gen) for n in (130, 90, 40)]
    ids = torch.zeros(3, 130, dtype=torch.long)
    mask = torch.zeros(3, 130, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 130 - len(r):], mask[i, 130 - len(r):] = r, 1
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    # per-layer budgets need batch size 1; KVzip scores one prompt (kvpress's press too)
    settings = [s for s in SETTINGS if s.method not in ("pyramidkv", "kvzip")]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True, **kw).logits[:, -1]
        shared = [decode(model, cache, first) for cache in session.caches]
    for cfg, logits in zip(settings, shared):
        assert torch.equal(logits, solo(model, cfg, ids, **kw)[2]), cfg.label()


def test_scores_that_settings_share_are_computed_once(monkeypatch):
    calls = {"window": 0, "h2o": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(snapkv_module, "window_attention", counting("window", snapkv_module.window_attention))
    monkeypatch.setattr(h2o_module, "accumulated_attention", counting("h2o", h2o_module.accumulated_attention))
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 150))
    settings = [snapkv.SnapKV(budget=b, window=8, kernel=k) for b in (48, 64) for k in (3, 5)]
    settings += [snapkv.SnapKV(budget=48, window=16), snapkv.H2O(budget=48, window=8),
                 snapkv.H2O(budget=64, window=16)]
    with snapkv.compress(model, settings), torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
    layers = model.config.num_hidden_layers
    assert calls == {"window": 2 * layers, "h2o": layers}  # windows 8 and 16; one accumulated sum


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3"])
def test_h2o_reads_the_queries_the_module_attended_with(monkeypatch, arch):
    """Every prompt query is the one the module handed its attention (one q_proj call a layer, not two),
    and the caches are the ones a projection made again gives, bit for bit."""
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    settings = [snapkv.H2O(budget=48, window=8), snapkv.SnapKV(budget=48, window=8, kernel=5)]
    snapkv.architectures.check_supported(model)  # each module's one-row probe (reading), once per model

    def prefill():
        calls = []
        hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: calls.append(out.shape[1]))
                 for layer in model.model.layers]
        with snapkv.compress(model, settings) as session, torch.no_grad():
            model(ids, cache=DynamicCache(config=model.config), use_cache=True)
            layers = [[(l.keys, l.values) for l in cache.layers] for cache in session.caches]
        for hook in hooks:
            hook.remove()
        return calls, layers
    n_layers = model.config.num_hidden_layers
    calls, kept = prefill()
    assert sorted(calls) == sorted([150, 8] * n_layers)  # the module's own; SnapKV's window projected again
    monkeypatch.setattr(snapkv.H2O, "reads_every_query", False)
    calls, projected_again = prefill()
    assert sorted(calls) == sorted([150] * 2 * n_layers + [8] * n_layers)
    for mine, again in zip(kept, projected_again):
        for (k, v), (k2, v2) in zip(mine, again):
            assert torch.equal(k, k2) and torch.equal(v, v2)


def test_generate_continues_each_cache():
    """A later turn through generate on each setting's cache equals the solo run's."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    settings = SETTINGS[:3]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        shared = [model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
                  for cache in session.caches]
    for cfg, got in zip(settings, shared):
        with snapkv.compress(model, cfg), torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, cache=cache, use_cache=True)
            want = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), cfg.label()


def test_empty_or_foreign_settings_are_errors():
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=r"cfg=\[\]"):
        snapkv.compress(model, []).__enter__()
    with pytest.raises(ValueError, match="not a compressor config"):
        snapkv.compress(model, [snapkv.SnapKV(), "snapkv"]).__enter__()
