"""ThinK (fewer key channels, ``snapkv.channels``): the channels kvpress's ThinKPress keeps, attention over the
stored channels against attention over keys whose other channels are zero (kvpress's way), the bytes really
saved (measured and planned), decoding in the harness, and a shared prefill."""
import gzip
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import snapkv
from snapkv.architectures import AttentionForm
from eval.runner import Runner, kv_cache_bytes, kv_bytes_per_token
from snapkv.channels import KeyChannelLayer, kept_channels
from snapkv.hooks import eager_attention_weights
from snapkv.memory import Shape, plan
from tiny_models import tiny_model

FIXTURE = "fixtures/kvpress/entries/think.json.gz"


def prompt(n=100, seed=0):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def compressed(model, cfg, ids, steps=6, forced=None, **kw):
    """A ThinK prefill then ``steps`` greedy tokens (or the ``forced`` continuation: a pass of several tokens):
    the cache, its channels and every step's last logits."""
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True, **kw)
        channels = kept_channels(cache)
        logits = [out.logits[:, -1]]
        if forced is not None:
            logits.append(model(forced, cache=cache, use_cache=True).logits[:, -1])
        for _ in range(steps):
            logits.append(model(logits[-1].argmax(-1)[:, None], cache=cache, use_cache=True).logits[:, -1])
    return cache, channels, torch.stack(logits, 1)


def zeroed(model, ids, channels, tokens, forced=None):
    """kvpress's way: the full prefill, the prompt's keys with every channel but ``channels`` zeroed, then the
    same continuation (``tokens``: the token fed at each step) over the whole cache."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True)
        for layer, rows in zip(cache.layers, channels):
            for row, heads in enumerate(rows):
                for head, kept in enumerate(heads):
                    dropped = torch.ones(layer.keys.shape[-1], dtype=torch.bool)
                    dropped[kept] = False
                    layer.keys[row, head, :, dropped] = 0
        logits = [out.logits[:, -1]]
        if forced is not None:
            logits.append(model(forced, cache=cache, use_cache=True).logits[:, -1])
        for token in tokens:
            logits.append(model(token[:, None], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, 1)


def test_the_channels_equal_kvpress_thinkpress_on_its_own_cases():
    """The fixture kvpress 0.5.5 wrote (tests/fixtures/kvpress/entries/write_think.py): every (layer, KV head)
    keeps the channels ThinKPress left unzeroed, every position, and the 8 greedy tokens are kvpress's
    (SmolLM2 in test_kvpress_parity, slow)."""
    from pathlib import Path

    from test_kvpress_parity import FIXTURES, kvpress_kept, run_cases
    record = json.loads(gzip.open(Path(__file__).parent / FIXTURE, "rt", encoding="utf-8").read())
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    cases = record["models"]["tiny_gqa"]["cases"]
    assert [case["ours"]["key_channel_ratio"] for case in cases] == [0.25, 0.5, 0.75, 0.875]
    for case, got, want, comparison, tokens in run_cases(model, record["models"]["tiny_gqa"]):
        channels = kvpress_kept(case, "channels", "channel_shape")
        head_dim = channels.shape[-1]
        assert (channels.sum(-1) == head_dim - int(head_dim * case["ratio"])).all()  # kvpress pruned some
        assert got.all() and want.all()  # every position kept
        assert comparison.equal and comparison.exact == channels.shape[0] * channels.shape[1], \
            comparison.describe(str(case["ratio"]))
        assert tokens == case["tokens"]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3", "llama-mha"])
@pytest.mark.parametrize("ratio", [0.25, 0.75])
def test_attention_over_the_stored_channels_equals_attention_over_zeroed_keys(attn, arch, ratio):
    model = tiny_model(arch, attn=attn)
    ids = prompt()
    cache, channels, logits = compressed(model, snapkv.ThinK(key_channel_ratio=ratio, window=16), ids)
    layer = cache.layers[0]
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 16
    kept = head_dim - int(head_dim * ratio)
    assert isinstance(layer, KeyChannelLayer) and layer.keys.shape[-1] == kept
    assert layer.prompt_length == 100 and layer.extra.shape[-2] == 6  # six decoded tokens keep every channel
    assert snapkv.kept_positions(cache)[0][0][0].tolist() == list(range(100))
    reference = zeroed(model, ids, channels, logits.argmax(-1)[:, :-1].T)
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_later_turn_of_several_tokens_attends_as_over_zeroed_keys(attn):
    """The question of ``query_aware=false`` (a pass of several tokens after the cut): causal among its tokens,
    every prompt key on its kept channels, its own keys whole."""
    model = tiny_model("llama-gqa", attn=attn)
    ids, question = prompt(), prompt(7, seed=1)
    _, channels, logits = compressed(model, snapkv.ThinK(window=8), ids, steps=3, forced=question)
    reference = zeroed(model, ids, channels, logits.argmax(-1)[:, 1:-1].T, forced=question)
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)


def test_the_layer_attention_is_eager_attention_over_zeroed_keys_with_kept_padding():
    torch.manual_seed(0)
    rows, kv_heads, groups, length, d = 2, 2, 3, 20, 8
    keys, values = torch.randn(rows, kv_heads, length, d), torch.randn(rows, kv_heads, length, d)
    channels = torch.stack([torch.randperm(d)[:5].sort().values for _ in range(rows * kv_heads)])
    channels = channels.view(rows, kv_heads, 5)
    layer = KeyChannelLayer(keys, values, channels)
    new_keys, new_values = torch.randn(rows, kv_heads, 3, d), torch.randn(rows, kv_heads, 3, d)
    layer.update(new_keys, new_values)
    query = torch.randn(rows, kv_heads * groups, 3, d)
    visible = torch.ones(rows, length + 3, dtype=torch.bool)
    visible[1, :4] = False  # row 1's kept padding
    got = layer.attend(query, AttentionForm(d ** -0.5), visible)
    full = keys.clone()
    for row in range(rows):
        for head in range(kv_heads):
            dropped = torch.ones(d, dtype=torch.bool)
            dropped[channels[row, head]] = False
            full[row, head, :, dropped] = 0
    full = torch.cat([full, new_keys], dim=2)
    weights = eager_attention_weights(query, full, visible)  # the last 3 positions causal, padding masked
    repeated = torch.cat([values, new_values], 2).repeat_interleave(groups, dim=1)
    torch.testing.assert_close(got, torch.matmul(weights, repeated), rtol=0, atol=1e-6)
    assert layer.keys.shape == (rows, kv_heads, length + 3, 5) and layer.extra.shape == (rows, kv_heads, 3, 3)


def test_the_cache_really_holds_fewer_bytes_and_the_planner_agrees():
    model = tiny_model("llama-gqa")
    config, length = model.config, 100
    cfg = snapkv.ThinK(key_channel_ratio=0.75)
    cache, _, _ = compressed(model, cfg, prompt(length), steps=0)
    full_bytes = kv_bytes_per_token(model) * length
    shape = Shape.of(config)
    kept = shape.head_dim - int(shape.head_dim * 0.75)
    index = config.num_hidden_layers * shape.kv_heads * shape.head_dim * 8  # channels and their complement
    keys, values = full_bytes // 2 * kept // shape.head_dim, full_bytes // 2
    assert kv_cache_bytes(cache) == keys + values + index < full_bytes
    assert plan(config, length, cfg, dtype="float32")["kv_cache_bytes"] == kv_cache_bytes(cache)
    assert plan(config, length, snapkv.ThinK(key_channel_ratio=0.0), dtype="float32")["kv_cache_bytes"] == full_bytes
    # decoded tokens keep every channel, as the planner's decoding term has them
    before = kv_cache_bytes(cache)
    with torch.no_grad(), snapkv.compress(model, cfg):
        model(torch.tensor([[3]]), cache=cache, use_cache=True)
    assert kv_cache_bytes(cache) - before == kv_bytes_per_token(model)
    planned = plan(config, length, cfg, dtype="float32", decode_tokens=1)
    assert planned["decode_peak_bytes"] - plan(config, length, cfg, dtype="float32")["decode_peak_bytes"] == \
        kv_bytes_per_token(model)


def test_generate_and_the_harness_decoding_run_after_it():
    model = tiny_model("llama-gqa")
    ids = prompt(120, seed=3)
    cfg = snapkv.ThinK(window=8)
    with snapkv.compress(model, cfg):
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 125)
    runner = Runner(model)
    alone = runner.generate(ids, cfg, 5)
    assert alone.tokens == out[0, 120:].tolist()
    settings = [snapkv.SnapKV(budget=48, window=8), cfg, snapkv.FullKV(), snapkv.ThinK(key_channel_ratio=0.25)]
    together = runner.generate_shared(ids, settings, 5, together=True)  # ThinK's caches decode alone
    assert together[1].tokens == alone.tokens and together[1].kv_cache_bytes == alone.kv_cache_bytes
    full = together[2]
    assert alone.kv_cache_bytes < together[3].kv_cache_bytes < full.kv_cache_bytes == full.cost()["full_kv_bytes"]
    assert alone.cost()["masked_kv_bytes"] == full.kv_cache_bytes  # what kvpress's zeroed cache holds
    asked = runner.generate(ids, cfg, 4, question_tokens=6)  # the question appended after the cut
    assert len(asked.tokens) == 4


def test_each_cache_of_a_shared_prefill_equals_its_solo_run_and_the_scores_are_shared(monkeypatch):
    import snapkv.methods.think as think
    calls = []
    scores = think.channel_scores
    monkeypatch.setattr(think, "channel_scores", lambda *a: calls.append(1) or scores(*a))
    model = tiny_model("qwen3")
    ids = prompt(90, seed=2)
    settings = [snapkv.ThinK(key_channel_ratio=0.5, window=8), snapkv.SnapKV(budget=48, window=8),
                snapkv.ThinK(key_channel_ratio=0.25, window=8), snapkv.FullKV(),
                snapkv.ThinK(key_channel_ratio=0.5, window=16)]
    with torch.no_grad(), snapkv.compress(model, settings) as session:
        first = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[:, -1]
        shared = [([(layer.keys.clone(), layer.values.clone(), getattr(layer, "channels", None))
                    for layer in cache.layers], cache) for cache in session.caches]
        steps = [model(first.argmax(-1)[:, None], cache=cache, use_cache=True).logits for _, cache in shared]
    assert len(calls) == 2 * model.config.num_hidden_layers  # windows 8 and 16, once per layer each
    for cfg, (layers, _), step in zip(settings, shared, steps):
        cache, _, logits = compressed(model, cfg, ids, steps=0)
        with torch.no_grad(), snapkv.compress(model, cfg):
            solo_step = model(logits[:, 0].argmax(-1)[:, None], cache=cache, use_cache=True).logits
        assert torch.equal(step, solo_step), cfg.label()
        for (keys, values, channels), layer in zip(layers, cache.layers):
            assert torch.equal(values, layer.values[..., :values.shape[-2], :]), cfg.label()
            assert torch.equal(keys, layer.keys[..., :keys.shape[-2], :]), cfg.label()
            if channels is not None:
                assert torch.equal(channels, layer.channels), cfg.label()


def test_a_left_padded_batch_keeps_each_rows_own_channels():
    model = tiny_model("llama-gqa")
    rows = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (90, 20)]
    ids, mask = torch.zeros(2, 90, dtype=torch.long), torch.zeros(2, 90, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 90 - len(r):], mask[i, 90 - len(r):] = r, 1
    cfg = snapkv.ThinK(window=32)  # the short row's window is its 20 tokens
    _, channels, logits = compressed(model, cfg, ids, steps=2, attention_mask=mask,
                                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for i, r in enumerate(rows):
        _, own, alone = compressed(model, cfg, r[None], steps=2)
        assert all(torch.equal(a, b) for layer, solo in zip(channels, own) for a, b in zip(layer[i], solo[0]))
        torch.testing.assert_close(logits[i], alone[0], rtol=1e-4, atol=1e-4)


def test_what_it_refuses():
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="key_channel_ratio=1"):
        snapkv.ThinK(key_channel_ratio=1.0)
    with pytest.raises(ValueError, match="gqa='repeat'"):
        snapkv.ThinK(gqa="repeat")
    assert snapkv.ThinK(budget=64, ratio=0.5) == snapkv.ThinK()  # every token kept: no size in tokens
    with torch.no_grad(), snapkv.compress(model, [snapkv.ThinK(window=8), snapkv.ThinK(window=8)]) as session:
        model(prompt(), cache=DynamicCache(config=model.config), use_cache=True)
        with pytest.raises(ValueError, match="decodes alone"):
            snapkv.merge_caches(session.caches)
    with torch.no_grad(), snapkv.compress(model, snapkv.ThinK(window=8), compress_later_turns=True):
        cache = DynamicCache(config=model.config)
        model(prompt(), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="cannot compress a later turn"):
            model(prompt(40, seed=5), cache=cache, use_cache=True)
