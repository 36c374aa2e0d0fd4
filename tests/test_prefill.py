"""The chunked prefill (``snapkv.prefill``): what each setting keeps and decodes equals the model's own one-pass
prefill (``prefill_chunk=None``), up to a tie at a cut (``tests/parity.py``: rows computed over fewer rows round
otherwise), for every method, padded batches, shared prefills and items in flight; what it holds (no mask as long
as the prompt, a layer's full keys and values freed once compressed); and SmolLM2's SnapKV against the official
``update_kv`` selection on the one-pass model's own queries and keys."""
from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import snapkv
from method_settings import RUNNABLE, small
from parity import compare_kept, kept_array
from snapkv.errors import InputError
from snapkv.prefill import PREFILL_CHUNK, DeferredRotary, PrefillLayer, check_chunk, chunk_bounds, split_attention
from tiny_models import tiny_model


def prefill_and_decode(model, cfgs, ids, chunk, steps: int = 5, **kwargs):
    """Each setting's kept positions, ranking scores and greedy tokens after one prefill of ``ids``."""
    with torch.no_grad(), snapkv.compress(model, cfgs, record_scores=True, prefill_chunk=chunk,
                                          **kwargs) as session:
        out = model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        caches, session.caches = session.caches, []
        first = out.logits[:, -1].argmax(-1)
        results = []
        for cache in caches:
            tokens = [first]
            for _ in range(steps):
                tokens.append(model(tokens[-1][:, None], cache=cache).logits[:, -1].argmax(-1))
            results.append((cache, torch.stack(tokens, dim=1)))
    return results


def assert_same_as_one_pass(model, cfgs, ids, chunk, **kwargs):
    one_pass = prefill_and_decode(model, cfgs, ids, None, **kwargs)
    chunked = prefill_and_decode(model, cfgs, ids, chunk, **kwargs)
    for cfg, (want_cache, want_tokens), (got_cache, got_tokens) in zip(cfgs, one_pass, chunked):
        want, got = kept_array(want_cache, ids.shape[1]), kept_array(got_cache, ids.shape[1])
        comparison = compare_kept(got, want, snapkv.ranking_scores(got_cache), label=f"chunked prefill {cfg.label()}")
        assert comparison.equal, comparison.describe(cfg.label())
        assert torch.equal(got_tokens, want_tokens), cfg.label()


def test_chunks_cover_the_prompt_and_the_last_is_as_long_as_the_rows_read():
    assert chunk_bounds(10, 4, 0) == [(0, 4), (4, 6), (6, 10)]
    assert chunk_bounds(10, 4, 7) == [(0, 3), (3, 10)]
    assert chunk_bounds(10, 4, None) == [(0, 10)]
    assert chunk_bounds(3, 4, 1) == [(0, 3)]
    assert chunk_bounds(8, 4, 4) == [(0, 4), (4, 8)]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "512"])
def test_a_chunk_is_a_positive_number_of_tokens_or_none(bad):
    assert check_chunk(None) is None and check_chunk(PREFILL_CHUNK) == PREFILL_CHUNK
    with pytest.raises(InputError, match=r"^prefill_chunk="):
        check_chunk(bad)
    with pytest.raises(InputError, match=r"^prefill_chunk="):
        snapkv.compress(tiny_model(), snapkv.SnapKV(budget=48, window=8), prefill_chunk=bad).__enter__()


@pytest.mark.parametrize("method", RUNNABLE)
def test_every_method_keeps_and_decodes_as_the_one_pass_prefill(method):
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(1))
    assert_same_as_one_pass(model, [small(method, budget=64)], ids, chunk=24)


def test_generate_writes_the_one_pass_prefills_tokens():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(10))
    outputs = []
    for chunk in (None, 32):
        with torch.no_grad(), snapkv.compress(model, small("snapkv", budget=64), prefill_chunk=chunk):
            outputs.append(model.generate(ids, max_new_tokens=8, do_sample=False))
    assert torch.equal(*outputs)


def test_finch_reads_its_question_from_the_last_chunk():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    assert_same_as_one_pass(model, [snapkv.build_config("finch", budget=64)], ids, chunk=16, question_tokens=40)


def test_a_padded_batch_and_a_shared_prefill_keep_what_the_one_pass_prefill_keeps():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (2, 120), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    cfgs = [small("snapkv", budget=48), snapkv.FullKV(), small("knorm", budget=40), small("h2o", budget=56)]
    results = []
    for chunk in (None, 32):
        with torch.no_grad(), snapkv.compress(model, cfgs, prefill_chunk=chunk) as session:
            out = model(ids, attention_mask=mask, cache=DynamicCache(config=model.config), use_cache=True,
                        logits_to_keep=1)
            results.append((out.logits, [snapkv.kept_positions(c) for c in session.caches]))
    (one_pass, one_pass_kept), (chunked, chunked_kept) = results
    assert torch.allclose(one_pass, chunked, atol=1e-5)
    for want, got in zip(one_pass_kept, chunked_kept):
        assert [[h.tolist() for h in row] for layer in want for row in layer] == \
               [[h.tolist() for h in row] for layer in got for row in layer]


def test_a_cache_made_without_the_models_config_grows_its_layers():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(9))
    logits = []
    for make in (lambda: DynamicCache(config=model.config), DynamicCache):
        with torch.no_grad(), snapkv.compress(model, small("snapkv", budget=48), prefill_chunk=16) as session:
            logits.append(model(ids, cache=make(), use_cache=True).logits)
            assert session.cache_lengths == [48] * len(model.model.layers)
    assert torch.equal(*logits)


def test_eager_attention_gets_masks_of_a_chunks_rows_only():
    model = tiny_model("llama-gqa", attn="eager")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    shapes = []
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["attention_mask"].shape)), with_kwargs=True)
        for layer in model.model.layers]
    try:
        assert_same_as_one_pass(model, [small("snapkv", budget=48)], ids, chunk=20)
    finally:
        for handle in handles:
            handle.remove()
    prefill = [shape for shape in shapes if shape[-2] > 1]
    assert (1, 1, 100, 100) in prefill  # the one-pass prefill's L x L mask
    chunked = prefill[len(prefill) // 2:]
    assert max(shape[-2] for shape in chunked) == 20 and {shape[-1] for shape in chunked} == {20, 40, 60, 80, 100}


def test_the_callers_embeddings_are_not_written_over():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(5))
    embeds = model.get_input_embeddings()(ids).detach()
    before = embeds.clone()
    with torch.no_grad(), snapkv.compress(model, small("snapkv", budget=48), prefill_chunk=16):
        by_embeds = model(inputs_embeds=embeds, cache=DynamicCache(config=model.config), use_cache=True).logits
    with torch.no_grad(), snapkv.compress(model, small("snapkv", budget=48), prefill_chunk=16):
        by_ids = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits
    assert torch.equal(embeds, before)
    assert torch.equal(by_embeds, by_ids)


def test_hidden_states_asked_for_run_the_one_pass_prefill():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = model(ids, output_hidden_states=True).hidden_states
        with snapkv.compress(model, small("snapkv", budget=48), prefill_chunk=16):
            hooked = model(ids, cache=DynamicCache(config=model.config), use_cache=True,
                           output_hidden_states=True).hidden_states
    assert len({id(h) for h in hooked}) == len(hooked)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))


def test_a_layers_full_keys_and_values_are_freed_once_it_is_compressed():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(7))
    buffers, alive_at_next_layer = [], []
    seen = weakref.WeakKeyDictionary()  # the layers alive: a freed layer's id may be reused by the next one
    update = PrefillLayer.update

    def recording(layer, key_states, value_states, *args, **kwargs):
        out = update(layer, key_states, value_states, *args, **kwargs)
        if layer not in seen:  # one buffer a layer, in layer order
            seen[layer] = len(buffers)
            buffers.append(weakref.ref(layer.keys))
        return out

    def check(module, args, kwargs):
        if module.layer_idx and kwargs["hidden_states"].shape[1] > 1:
            alive_at_next_layer.append(buffers[module.layer_idx - 1]() is not None)
    handles = [layer.self_attn.register_forward_pre_hook(check, with_kwargs=True) for layer in model.model.layers]
    PrefillLayer.update = recording
    try:
        with torch.no_grad(), snapkv.compress(model, small("snapkv", budget=48), prefill_chunk=50):
            buffers.clear()
            seen.clear()
            model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    finally:
        PrefillLayer.update = update
        for handle in handles:
            handle.remove()
    assert len(buffers) == len(model.model.layers)
    assert len(alive_at_next_layer) == (len(model.model.layers) - 1) * 4 and not any(alive_at_next_layer)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_a_split_chunk_attends_as_sdpa_with_the_chunks_mask(heads, kv_heads):
    torch.manual_seed(heads)
    q_len, length, d = 24, 100, 16
    query = torch.randn(2, heads, q_len, d)
    key, value = torch.randn(2, kv_heads, length, d), torch.randn(2, kv_heads, length, d)
    visible = torch.ones(q_len, length, dtype=torch.bool).tril(length - q_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1),
        attn_mask=visible, scale=0.3)
    got, _ = split_attention(None, query, key, value, scaling=0.3)
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-6)


def test_position_embeddings_read_outside_the_layers_say_so():
    deferred = DeferredRotary(lambda x, positions: (x, x), torch.zeros(1, 4, 2), torch.arange(4)[None])
    assert deferred.rows(1, 3)[0].shape == (1, 2, 2)
    with pytest.raises(TypeError, match="prefill_chunk=None"):
        cos, sin = deferred


def test_items_in_flight_decode_as_with_the_one_pass_prefill():
    from eval.runner import Runner
    model = tiny_model("llama-gqa")
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 130)]
    cfgs = [small("snapkv", budget=48), snapkv.FullKV()]
    runs = [Runner(model, prefill_chunk=chunk).generate_items(prompts, cfgs, 6) for chunk in (None, 16)]
    tokens = [[[g.tokens for g in per_setting] for per_setting in run] for run in runs]
    assert tokens[0] == tokens[1]


@pytest.mark.slow
def test_smollm2_keeps_the_official_snapkv_selection_with_a_chunked_prefill(smollm2):
    """SmolLM2, 1,024 tokens in chunks of 256: per layer and query head, the positions the official SnapKV
    ``update_kv`` keeps (``tests/test_select.py``'s transcription, on KV repeated to every query head) from the
    queries and keys of the model's own one-pass prefill."""
    from test_select import official_selection
    from snapkv.architectures import window_queries
    model = smollm2[0]
    ids = torch.randint(100, 40000, (1, 1024), generator=torch.Generator().manual_seed(8))
    cfg = snapkv.SnapKV(budget=256, window=32, kernel=7, pooling="maxpool", gqa="repeat")
    inputs = {}

    def keep_inputs(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])
    handles = [layer.self_attn.register_forward_pre_hook(keep_inputs, with_kwargs=True)
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            want = np.zeros((len(model.model.layers), model.config.num_attention_heads, 1024), dtype=bool)
            for idx, layer in enumerate(model.model.layers):
                hidden, position = inputs[idx]
                queries = window_queries(layer.self_attn, hidden, position, cfg.window)
                top = official_selection(queries, cache.layers[idx].keys, cfg.budget, cfg.window, cfg.kernel,
                                         cfg.pooling)
                want[idx, np.arange(want.shape[1])[:, None], top[0].numpy()] = True
                want[idx, :, -cfg.window:] = True
    finally:
        for handle in handles:
            handle.remove()
    (got_cache, _), = prefill_and_decode(model, [cfg], ids, 256, steps=1)
    comparison = compare_kept(kept_array(got_cache, 1024), want, snapkv.ranking_scores(got_cache),
                              label="official SnapKV, chunked prefill")
    assert comparison.equal, comparison.describe("SmolLM2 SnapKV")


def test_the_model_sections_default_chunk_is_the_sessions():
    from eval.sections import ModelSection
    from snapkv.memory import plan
    import inspect
    assert ModelSection.prefill_chunk == PREFILL_CHUNK
    assert inspect.signature(snapkv.compress).parameters["prefill_chunk"].default == PREFILL_CHUNK
    assert inspect.signature(plan).parameters["prefill_chunk"].default == PREFILL_CHUNK
