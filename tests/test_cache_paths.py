"""A compressed cache on every path a user takes: multi-token continuations, a second turn through
generate, several caches in one session, every attention implementation; the paths that cannot be
right are refused; chunked MLPs on dense and MoE blocks; the module's own attention scaling."""
import math

import pytest
import torch
from transformers import DynamicCache, StaticCache

import snapkv
from tiny_models import tiny_model

CONFIGS = {
    "snapkv": snapkv.SnapKV(budget=48, window=8, kernel=5),
    "pyramidkv": snapkv.PyramidKV(budget=48, window=8, kernel=5),
    "snapkv-repeat": snapkv.SnapKV(budget=48, window=8, kernel=5, gqa="repeat"),
}


def fresh_cache(model):
    return DynamicCache(config=model.config)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_continuation_of_k_tokens_equals_k_single_steps(attn, method):
    model = tiny_model("llama-gqa", attn=attn)
    ids, more = torch.randint(0, 128, (1, 160)), torch.randint(0, 128, (1, 5))
    with snapkv.compress(model, CONFIGS[method]) as session, torch.no_grad():
        a, b = fresh_cache(model), fresh_cache(model)
        model(ids, cache=a, use_cache=True)
        model(ids, cache=b, use_cache=True)
        lengths = session.cache_lengths
        if method == "pyramidkv":
            assert len(set(lengths)) > 1                     # layers of different lengths
        together = model(more, cache=a, use_cache=True).logits
        steps = torch.cat([model(more[:, i:i + 1], cache=b, use_cache=True).logits for i in range(5)], dim=1)
    torch.testing.assert_close(together, steps, rtol=1e-5, atol=1e-5)
    assert [l.keys.shape[-2] for l in a.layers] == [n + 5 for n in lengths]


def test_several_caches_alive_in_one_session():
    model = tiny_model("llama-gqa")
    first, second = torch.randint(0, 128, (1, 150)), torch.randint(0, 128, (1, 90))
    nxt = torch.randint(0, 128, (1, 1))
    with snapkv.compress(model, CONFIGS["snapkv"]), torch.no_grad():
        alone = fresh_cache(model)
        model(first, cache=alone, use_cache=True)
        expected = model(nxt, cache=alone, use_cache=True).logits
        a, b = fresh_cache(model), fresh_cache(model)
        model(first, cache=a, use_cache=True)
        model(second, cache=b, use_cache=True)          # a second prefill in between
        got = model(nxt, cache=a, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_second_turn_through_generate(attn):
    model = tiny_model("llama-gqa", attn=attn)
    turn1, turn2 = torch.randint(0, 128, (1, 150)), torch.randint(0, 128, (1, 12))
    with snapkv.compress(model, CONFIGS["pyramidkv"]) as session, torch.no_grad():
        cache = fresh_cache(model)
        out1 = model.generate(turn1, cache=cache, max_new_tokens=4, do_sample=False)
        kept = [l.keys.shape[-2] for l in cache.layers]
        assert kept == [n + 3 for n in session.cache_lengths]    # the 4th token is not fed yet
        history = torch.cat([out1, turn2], dim=1)
        out2 = model.generate(history, cache=cache, max_new_tokens=3, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        # the same continuation by hand: the unfed 4th token and turn 2 at once, at their positions
        manual = fresh_cache(model)
        model(turn1, cache=manual, use_cache=True)
        model(out1[:, 150:153], cache=manual, use_cache=True)
        logits = model(history[:, 153:], cache=manual, use_cache=True).logits[:, -1]
    torch.testing.assert_close(out2.logits[0], logits, rtol=1e-5, atol=1e-5)
    assert [l.keys.shape[-2] for l in cache.layers] == [n + 3 + 1 + 12 + 2 for n in session.cache_lengths]


def test_later_turns_are_compressed_on_request():
    model = tiny_model("llama-gqa")
    turn1, turn2 = torch.randint(0, 128, (1, 150)), torch.randint(0, 128, (1, 30))
    with snapkv.compress(model, CONFIGS["snapkv"], compress_later_turns=True), torch.no_grad():
        cache = fresh_cache(model)
        model(turn1, cache=cache, use_cache=True)
        model(turn2, cache=cache, use_cache=True)
        assert [l.keys.shape[-2] for l in cache.layers] == [48] * 3
        step = model(torch.randint(0, 128, (1, 1)), cache=cache, use_cache=True).logits
    assert torch.isfinite(step).all()


def test_paths_that_cannot_be_right_are_refused():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 100))
    with snapkv.compress(model, CONFIGS["snapkv"]):
        with pytest.raises(ValueError, match="num_beams > 1"):
            model.generate(ids, num_beams=2, max_new_tokens=2)
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            model.generate(ids, prefill_chunk_size=32, max_new_tokens=2)
        with pytest.raises(ValueError, match="cache=StaticCache"):
            model.generate(ids, cache=StaticCache(config=model.config, max_cache_len=128), max_new_tokens=2)
        with pytest.raises(ValueError, match="cache=DynamicCache"):
            model(ids, cache=DynamicCache(config=model.config, offloading=True), use_cache=True)
    out = model.generate(ids, num_beams=2, max_new_tokens=2, do_sample=False)   # restored outside the context
    assert out.shape == (1, 102)


def test_selection_reads_the_modules_own_scaling():
    from snapkv.select import window_attention
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 40, 16)
    default = window_attention(q, k, 8)
    assert torch.equal(default, window_attention(q, k, 8, scaling=1 / math.sqrt(16)))
    scaled = window_attention(q, k, 8, scaling=0.5)
    repeated = k.repeat_interleave(2, dim=1)
    scores = (q @ repeated.transpose(-1, -2)) * 0.5
    scores[..., -8:] += torch.full((8, 8), torch.finfo(q.dtype).min).triu(1)
    expected = torch.softmax(scores, dim=-1)[..., :-8].sum(dim=-2)
    torch.testing.assert_close(scaled, expected)


@pytest.mark.parametrize("arch", ["llama-gqa", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_chunked_mlp_is_exact_at_any_batch(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (3, 70))
    with torch.no_grad():
        ref = model(ids).logits
        with snapkv.chunked_mlp(model, 16):
            got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    layer = model.model.layers[0]
    assert "forward" not in vars(getattr(layer, "mlp", None) or layer.block_sparse_moe)  # restored


def test_h2o_sums_in_the_model_dtype_as_kvcache_factory():
    from snapkv.methods.h2o import accumulated_attention
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 200, 16).bfloat16(), torch.randn(1, 2, 200, 16).bfloat16()
    # H2OKVCluster.update_kv: full causal attention, softmax in float32 cast back, summed over queries
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores + torch.full((200, 200), torch.finfo(scores.dtype).min).triu(1).bfloat16()
    official = torch.softmax(scores, dim=-1, dtype=torch.float32).to(torch.bfloat16).sum(dim=-2)
    got = accumulated_attention(q, k)
    assert got.dtype == torch.bfloat16 and torch.equal(got, official)
    exact = accumulated_attention(q, k, accumulate="float32")
    assert exact.dtype == torch.float32 and not torch.equal(exact, official.float())


@pytest.mark.parametrize("padded", [False, True])
def test_h2o_chunks_of_queries_and_heads_equal_the_one_shot_sum(monkeypatch, padded):
    """Several query chunks, each scored against its causal prefix only, one KV head at a time."""
    import snapkv.methods.h2o as h2o
    monkeypatch.setattr(h2o, "_CPU_QUERY_CHUNK", 64)
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 300, 16)
    mask = torch.ones(2, 300, dtype=torch.bool)
    if padded:
        mask[1, :37] = False
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / math.sqrt(16)
    blocked = torch.ones(300, 300, dtype=torch.bool).triu(1) | ~mask[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(blocked, torch.finfo(scores.dtype).min), dim=-1) * mask[:, None, :, None]
    got = h2o.accumulated_attention(q, k, mask if padded else None)
    torch.testing.assert_close(got, probs.sum(dim=-2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [None, 0.125, 0.3])
def test_h2o_chunks_in_bfloat16_round_once_as_the_one_shot_sum(monkeypatch, scaling):
    """Chunk sums added in float32 and rounded once: the official bf16 one-shot sum, not a sum rounded
    to bf16 after every chunk. A power-of-two scale (1/sqrt(16), 1/8) is applied to the queries before
    the matmul, any other to the scores after it, as the official code does: the same bits either way."""
    import snapkv.methods.h2o as h2o
    monkeypatch.setattr(h2o, "_CPU_QUERY_CHUNK", 32)
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 200, 16).bfloat16(), torch.randn(1, 2, 200, 16).bfloat16()
    scores = (q @ k.transpose(-1, -2))
    scores = scores / math.sqrt(16) if scaling is None else scores * scaling
    scores = scores + torch.full((200, 200), torch.finfo(scores.dtype).min).triu(1).bfloat16()
    official = torch.softmax(scores, dim=-1, dtype=torch.float32).to(torch.bfloat16).sum(dim=-2)
    got = h2o.accumulated_attention(q, k, scaling=scaling)
    assert got.dtype == torch.bfloat16 and torch.equal(got, official)
