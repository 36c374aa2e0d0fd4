"""Decoding the settings of one prefill as one batch (``snapkv.merge_caches``, ``decode_together``)."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from method_settings import with_every_method
from eval.runner import Runner, cheapest_cuts
from tiny_models import tiny_model

SETTINGS = [cfg for cfg in with_every_method([
    snapkv.FullKV(),
    snapkv.SnapKV(budget=48, window=8, kernel=5),
    snapkv.SnapKV(budget=64, window=8, kernel=3, pooling="avgpool"),
    snapkv.PyramidKV(budget=48, window=8, kernel=5),
    snapkv.H2O(budget=40, window=8),
    snapkv.StreamingLLM(budget=56, sink_tokens=4),
], distinct_from=72, step=20) if not cfg.head_adaptive and not cfg.stores_key_channels]
# (lengths of their own: every setting's cache differs; head-adaptive caches and fewer key channels decode alone)
PROMPT = max(cfg.budget or 0 for cfg in SETTINGS) + 40  # longer than every budget: every setting cuts
HEAD_ADAPTIVE = [snapkv.AdaKV(budget=48, window=8), snapkv.CriticalAdaKV(budget=56, window=8)]
FORCED = [5, 17, 99, 3, 42, 7]


def forced_logits(model, cache, first, rows_per_setting=1):
    """Logits of a fixed continuation (the same tokens for every row), so rows compare step by step."""
    out = [first]
    for token in FORCED:
        ids = torch.full((first.shape[0], 1), token)
        out.append(model(ids, cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_merged_cache_decodes_each_setting_as_its_own_cache(attn):
    model = tiny_model("llama-gqa", attn=attn)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    with snapkv.compress(model, SETTINGS) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
        caches = session.caches
        lengths = session.lengths_per_setting
        # padding is needed, per layer for PyramidKV (a method keeping whole chunks may meet another's length)
        assert len({tuple(n) for n in lengths}) >= len(SETTINGS) - 1
        alone = [forced_logits(model, cache, first) for cache in caches]
    with snapkv.compress(model, SETTINGS) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
        merged = snapkv.merge_caches(session.caches)
        assert all(layer.keys is None for cache in session.caches for layer in cache.layers)  # emptied
        together = forced_logits(model, merged, first.repeat(len(SETTINGS), 1))
    for i, cfg in enumerate(SETTINGS):
        torch.testing.assert_close(together[i], alone[i][0], rtol=1e-5, atol=1e-5, msg=cfg.label())


def test_left_padded_rows_merge_with_their_kept_padding():
    model = tiny_model("llama-gqa")
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 128, (n,), generator=gen) for n in (130, 60)]
    ids = torch.zeros(2, 130, dtype=torch.long)
    mask = torch.zeros(2, 130, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 130 - len(r):], mask[i, 130 - len(r):] = r, 1
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    settings = [snapkv.SnapKV(budget=80, window=8), snapkv.SnapKV(budget=48, window=8)]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True, **kw).logits[:, -1]
        alone = [forced_logits(model, cache, first) for cache in session.caches]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True, **kw).logits[:, -1]
        together = forced_logits(model, snapkv.merge_caches(session.caches), first.repeat(2, 1))
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_runner_decodes_together_and_reports_each_setting():
    model = tiny_model("llama-gqa")
    runner = Runner(model)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    exact = runner.generate_shared(ids, SETTINGS, 12)
    together = runner.generate_shared(ids, SETTINGS, 12, together=True)
    for cfg, a, b in zip(SETTINGS, exact, together):
        assert a.tokens == b.tokens, cfg.label()
        assert (a.cache_lengths, a.kv_cache_bytes) == (b.cache_lengths, b.kv_cache_bytes)
    stop = together[1].tokens[3]  # one setting stops early, the others run on
    stopped = runner.generate_shared(ids, SETTINGS, 12, stop_ids=[stop], together=True)
    for a, b in zip(runner.generate_shared(ids, SETTINGS, 12, stop_ids=[stop]), stopped):
        assert a.tokens == b.tokens


def test_with_sdpa_each_member_attends_over_its_own_slots_only(monkeypatch):
    """A merged sdpa batch runs one attention call per member on that member's slots (no padding read),
    and the model's attention implementation is sdpa again after each layer, and after a failed step."""
    import snapkv.transformers_workarounds as workarounds
    model = tiny_model("llama-gqa", attn="sdpa")
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    calls = []
    real = workarounds.ragged_attention

    def spy(module, query, key, value, attention_mask, snapkv_segments=None, **kwargs):
        calls.append((module.config._attn_implementation, key.shape[-2], snapkv_segments))
        return real(module, query, key, value, attention_mask, snapkv_segments, **kwargs)
    monkeypatch.setattr(workarounds, "ragged_attention", spy)
    from transformers import AttentionInterface
    monkeypatch.setitem(AttentionInterface._global_mapping, workarounds.RAGGED_ATTENTION, spy)
    with snapkv.compress(model, SETTINGS) as session, torch.no_grad():
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
        lengths = session.lengths_per_setting
        merged = snapkv.merge_caches(session.caches)
        model(first.argmax(-1).repeat(len(SETTINGS))[:, None], cache=merged, use_cache=True)
        assert model.config._attn_implementation == "sdpa"
        n_layers = model.config.num_hidden_layers
        assert len(calls) == n_layers
        for layer, (name, padded_length, segments) in enumerate(calls):
            longest = max(n[layer] for n in lengths)
            assert name == workarounds.RAGGED_ATTENTION and padded_length == longest + 1
            assert segments == [(i, i + 1, longest - n[layer]) for i, n in enumerate(lengths)]

        def fail(*args, **kwargs):
            raise RuntimeError("out of memory")
        monkeypatch.setitem(AttentionInterface._global_mapping, workarounds.RAGGED_ATTENTION, fail)
        with pytest.raises(RuntimeError):
            model(first.argmax(-1).repeat(len(SETTINGS))[:, None], cache=merged, use_cache=True)
    assert model.config._attn_implementation == "sdpa"   # put back when the context ends


def test_a_finished_member_stops_reading_its_slots_and_the_others_decode_on_exactly(monkeypatch):
    """After ``finish_member`` a member's rows attend over nothing (zero output, one sdpa call fewer a
    layer); every other row's logits are the same bits as when it goes on reading."""
    import snapkv.transformers_workarounds as workarounds
    from transformers import AttentionInterface
    from snapkv.merge import finish_member
    model = tiny_model("llama-gqa", attn="sdpa")
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    calls = []

    def counting(module, query, key, value, attention_mask, snapkv_segments=None, **kwargs):
        calls.append(len(snapkv_segments))
        return workarounds.ragged_attention(module, query, key, value, attention_mask, snapkv_segments, **kwargs)
    monkeypatch.setitem(AttentionInterface._global_mapping, workarounds.RAGGED_ATTENTION, counting)

    def decode(finished):
        with snapkv.compress(model, SETTINGS) as session, torch.no_grad():
            first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
            merged = snapkv.merge_caches(session.caches, spare_tokens=4)
            out = [model(first.argmax(-1).repeat(len(SETTINGS))[:, None], cache=merged, use_cache=True).logits]
            for row in finished:
                finish_member(merged, row)
            for token in FORCED[:3]:
                out.append(model(torch.full((len(SETTINGS), 1), token), cache=merged, use_cache=True).logits)
        return torch.cat(out, 1)
    reading = decode([])
    calls.clear()
    finished = decode([0, 3])
    n_layers = model.config.num_hidden_layers
    assert calls == [len(SETTINGS)] * n_layers + [len(SETTINGS) - 2] * 3 * n_layers
    assert torch.equal(finished[:, 0], reading[:, 0])
    others = [1, 2, 4, 5]
    assert torch.equal(finished[others], reading[others])
    assert not torch.equal(finished[[0, 3], 1:], reading[[0, 3], 1:])


def test_batches_keep_layouts_apart_and_full_alone_when_it_costs_more():
    model = tiny_model("llama-gqa", attn="eager")   # masked batches: every row reads the longest
    runner = Runner(model)
    settings = [snapkv.FullKV(), snapkv.SnapKV(budget=48, window=8),
                snapkv.SnapKV(budget=48, window=8, gqa="repeat"), snapkv.SnapKV(budget=56, window=8)]
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(6))
    with snapkv.compress(model, settings) as session, torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        runner.weight_bytes = 0      # reads of the weights cost nothing: no batch pays for padding
        assert sorted(map(sorted, runner.decode_batches(session.caches))) == [[0], [1], [2], [3]]
        runner.weight_bytes = 10**12  # the weights dominate: one batch per layout
        assert sorted(map(sorted, runner.decode_batches(session.caches))) == [[0, 1, 3], [2]]
        with pytest.raises(snapkv.InputError, match="different heads per layer"):
            snapkv.merge_caches(session.caches[1:3])
    sdpa = Runner(tiny_model("llama-gqa", attn="sdpa"))
    with snapkv.compress(sdpa.model, settings) as session, torch.no_grad():
        sdpa.model(ids, cache=DynamicCache(config=sdpa.model.config), use_cache=True)
        sdpa.weight_bytes = 0         # no padding is read: one batch per layout whatever the weights cost
        assert sorted(map(sorted, sdpa.decode_batches(session.caches))) == [[0, 1, 3], [2]]


def test_cheapest_cuts():
    assert cheapest_cuts([1, 2, 3, 1000], fixed=100) == [(0, 3), (3, 4)]
    assert cheapest_cuts([1, 2, 3, 1000], fixed=10**6) == [(0, 4)]
    assert cheapest_cuts([5, 5, 5], fixed=0) in ([(0, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)],
                                                 [(0, 1), (1, 3)])
    assert cheapest_cuts([1, 50], fixed=10) == [(0, 1), (1, 2)]
    assert cheapest_cuts([], fixed=10) == []


def test_foreign_caches_are_refused():
    with pytest.raises(snapkv.InputError, match="snapkv.compress"):
        snapkv.merge_caches([DynamicCache()])


def test_a_merged_layer_writes_into_its_room_and_grows():
    from snapkv.merge import GrowingLayer
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    layer = GrowingLayer(keys, values, spare=2)
    room = layer._keys
    for step in range(4):
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        keys, values = torch.cat([keys, k], -2), torch.cat([values, v], -2)
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values) and layer.get_seq_length() == 6 + step
        assert (layer._keys is room) == (step < 2)  # written in place while the room lasts, then doubled


def test_weight_major_linears_compute_each_projection_and_then_step_aside():
    model = tiny_model("llama-gqa")
    model.lm_head.bias = torch.nn.Parameter(torch.randn(model.lm_head.out_features))  # a bias is added too
    ids = torch.randint(0, 128, (5, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids).logits
        with snapkv.merge.weight_major_linears(model):
            assert all("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)
            weight_major = model(ids).logits
        assert not any("forward" in vars(m) for m in model.modules())
        assert torch.equal(model(ids).logits, plain)
    torch.testing.assert_close(weight_major, plain, rtol=1e-5, atol=1e-5)


def test_merged_decoding_runs_weight_major_and_drops_it_after(monkeypatch):
    model = tiny_model("llama-gqa", attn="sdpa")
    runner = Runner(model)
    calls = []
    original = snapkv.merge._weight_major

    def counted(linear, x):
        calls.append(x.shape[0])
        return original(linear, x)
    monkeypatch.setattr(snapkv.merge, "_weight_major", counted)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(8))
    together = runner.generate_shared(ids, SETTINGS[:3], 6, together=True)
    assert calls and set(calls) == {3}  # three settings' rows per projection
    assert not any("forward" in vars(m) for m in model.modules())
    calls.clear()
    exact = runner.generate_shared(ids, SETTINGS[:3], 6)
    assert not calls
    assert [g.tokens for g in together] == [g.tokens for g in exact]


def test_head_adaptive_caches_are_refused_by_merge_and_decode_alone_in_a_together_run():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    settings = [snapkv.SnapKV(budget=48, window=8), *HEAD_ADAPTIVE, snapkv.SnapKV(budget=64, window=8)]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        with pytest.raises(snapkv.InputError, match="head-adaptive cache .* decodes alone"):
            snapkv.merge_caches(session.caches[:2])
        assert Runner(model).decode_batches(session.caches) == [[0, 3], [1], [2]]
    runner = Runner(model)
    solo = [runner.generate(ids, cfg, 8).tokens for cfg in settings]
    together = runner.generate_shared(ids, settings, 8, together=True)
    assert [g.tokens for g in together] == solo
