"""Every decoder-only family in ``snapkv.families`` is read exactly as the model attends, or refused in one line.

A tiny random model of each family (eager attention, 3 layers, 4 query and 2 KV heads, a 120-token prompt; hybrid
models with a sliding window of 48 on their first and last layers):

- SnapKV's kept positions on every compressed layer equal the selection the official ``update_kv`` makes from the
  model's own attention weights (``output_attentions``: the window's rows summed, max-pooled, top-k per query head),
  up to a tie at the cut (``tests/parity.py``), in one chunk and in chunks of 32 (``snapkv.prefill``); a sliding
  layer holds what the model's own sliding cache holds, its last ``window - 1`` positions;
- the greedy tokens ``generate`` writes on each representative method's cache equal the model's own: the whole
  prompt prefilled by the model, then each step attending, on every layer, to the positions that layer kept (a
  per-head mask over the full cache, the model's sliding window on a sliding layer) and every decoded token;
- a method's RoPE statistics use the layer's own rotation (Expected Attention: ``rotation_matrices`` times the
  queries before RoPE equals the module's queries after it);
- a family the compressor cannot read is refused before any prefill, with one line naming why."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import snapkv
from parity import compare_kept, kept_array
from snapkv.cache_state import state_of
from snapkv.architectures import attention_of, module_call, prerope_queries, reading, rotation_matrices
from snapkv.families import FAMILIES
from snapkv.prefill import PREFILL_CHUNK

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
READ = {family.name: family for family in FAMILIES if not family.refused}
REFUSED = {family.name: family for family in FAMILIES if family.refused}
WINDOW, BUDGET, KERNEL, LENGTH, STEPS = 8, 40, 5, 120, 6


def build(family, **extra):
    config = AutoConfig.for_model(family.model_type, **{**COMMON, **family.tiny, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random init attends nearly uniformly: sharpen it so the selection means something
        for layer in getattr(model.base_model, "layers", []):
            for name in ("q_proj", "k_proj", "qkv_proj", "query_key_value"):
                projection = getattr(attention_of(layer), name, None)
                if projection is not None:
                    projection.weight.mul_(4.0)
            sinks = getattr(attention_of(layer), "sinks", None)
            if sinks is not None:  # gpt-oss: sinks that weigh in the softmax
                sinks.copy_(torch.randn(sinks.shape, generator=torch.Generator().manual_seed(2)) * 3)
    return model


def prompt(vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (1, LENGTH), generator=torch.Generator().manual_seed(1))


def sliding(model, layer: int) -> int | None:
    return reading(attention_of(model.base_model.layers[layer])).form.sliding_window


def official_selection(model, ids, gqa: str) -> np.ndarray:
    """``[layers, heads, L]``: the official SnapKV selection (``update_kv``) on the model's own attention weights, per
    query head (``repeat``) or on each KV group's mean (``mean``); a sliding layer: its last ``window - 1``."""
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    kv_heads = reading(attention_of(model.base_model.layers[0])).kv_heads
    heads = weights[0].shape[1] if gqa == "repeat" else kv_heads
    kept = np.zeros((len(weights), heads, LENGTH), dtype=bool)
    for layer, w in enumerate(weights):
        window = sliding(model, layer)
        if window is not None:
            kept[layer, :, LENGTH - (window - 1):] = True
            continue
        votes = w[:, :, -WINDOW:, :-WINDOW].float().sum(dim=-2)
        pooled = F.max_pool1d(votes, kernel_size=KERNEL, padding=KERNEL // 2, stride=1)
        if gqa == "mean":
            pooled = pooled.view(1, kv_heads, -1, pooled.shape[-1]).mean(dim=2)
        top = pooled.topk(BUDGET - WINDOW, dim=-1).indices[0]
        kept[layer, np.arange(heads)[:, None], top.numpy()] = True
        kept[layer, :, -WINDOW:] = True
    return kept


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 32], ids=["one-chunk", "chunks-of-32"])
@pytest.mark.parametrize("name", sorted(READ))
def test_a_family_is_read_as_the_model_attends(name, chunk):
    model = build(READ[name])
    ids = prompt()
    want = official_selection(model, ids, "repeat")
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL, pooling="maxpool", gqa="repeat")
    with torch.no_grad(), snapkv.compress(model, cfg, record_scores=True, prefill_chunk=chunk) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        cache = session.caches[0]
    per_layer = snapkv.kept_positions(cache)
    full = []
    for layer, per_row in enumerate(per_layer):
        got = np.zeros((len(per_row[0]), LENGTH), dtype=bool)
        for head, positions in enumerate(per_row[0]):
            got[head, positions.numpy()] = True
        if sliding(model, layer) is not None:  # KV heads: each query head reads its group's
            assert (np.repeat(got, want.shape[1] // got.shape[0], axis=0) == want[layer]).all(), f"{name}: {layer}"
        else:
            full.append((layer, got))
    if full:
        scores = [snapkv.ranking_scores(cache)[layer] for layer, _ in full]
        comparison = compare_kept(np.stack([got for _, got in full]), want[[layer for layer, _ in full]], scores,
                                  label=f"family {name}")
        assert comparison.equal, comparison.describe(name)


@pytest.mark.parametrize("name", sorted(READ))
def test_h2o_reads_every_query_as_the_model_attends(name):
    """H2O's accumulated attention of every prompt query (KVCache-Factory's ``H2OKVCluster``) on each compressed
    layer equals the model's own weights summed over its queries: the layer's scaling, soft-capping and sinks."""
    model = build(READ[name])
    ids = prompt()
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    cfg = snapkv.H2O(budget=BUDGET, window=WINDOW, gqa="repeat")
    with torch.no_grad(), snapkv.compress(model, cfg, record_scores=True) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        cache = session.caches[0]
    full = [layer for layer in range(len(weights)) if sliding(model, layer) is None]
    want = np.zeros((len(full), weights[0].shape[1], LENGTH), dtype=bool)
    got = np.zeros_like(want)
    for row, layer in enumerate(full):
        top = weights[layer][0, :, :, :-WINDOW].sum(dim=-2).topk(BUDGET - WINDOW, dim=-1).indices
        want[row, np.arange(want.shape[1])[:, None], top.numpy()] = True
        want[row, :, -WINDOW:] = True
        for head, positions in enumerate(snapkv.kept_positions(cache)[layer][0]):
            got[row, head, positions.numpy()] = True
    comparison = compare_kept(got, want, [snapkv.ranking_scores(cache)[layer] for layer in full],
                              label=f"family {name} h2o")
    assert comparison.equal, comparison.describe(name)


def tokens_attending_to(model, ids, kept: list, steps: int, dropped: dict | None = None):
    """Greedy tokens (and each step's logits) of the model over its own whole-prompt cache, each step's attention on
    layer ``i`` limited to the prompt positions ``kept[i][0][head]`` and every decoded token (a sliding layer: the
    model's window); ``dropped``: layer -> ``[kv_heads, c]`` key channels zeroed in the prompt's keys (ThinK)."""
    heads = model.config.num_attention_heads
    cache = DynamicCache()  # every layer whole: the masks below say what each layer sees
    with torch.no_grad():
        logits = [model(ids, cache=cache, use_cache=True).logits[:, -1]]
        for idx, channels in (dropped or {}).items():
            keys = cache.layers[idx].keys
            for head, pruned in enumerate(channels):
                keys[0, head, :LENGTH, pruned] = 0
    token = logits[0].argmax(-1)
    tokens, layers = [int(token)], model.base_model.layers

    def limiting(idx):
        def hook(module, args, kwargs):
            total = cache.layers[idx].keys.shape[-2] + 1
            position = total - 1
            keys_at = torch.arange(total)
            window = sliding(model, idx)
            if window is not None:
                visible = (keys_at > position - window).expand(heads, total).clone()
            else:
                per_head = kept[idx][0]
                visible = torch.zeros(len(per_head), total, dtype=torch.bool)
                for head, positions in enumerate(per_head):
                    visible[head, positions] = True
                visible[:, LENGTH:] = True
                visible = visible.repeat_interleave(heads // len(per_head), dim=0)
            mask = torch.zeros(1, heads, 1, total).masked_fill(~visible[None, :, None], torch.finfo(torch.float32).min)
            kwargs["attention_mask"] = mask
            return args, kwargs
        return hook
    handles = [attention_of(layer).register_forward_pre_hook(limiting(idx), with_kwargs=True)
               for idx, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for step in range(steps - 1):
                position = torch.tensor([[LENGTH + step]])
                out = model(token[:, None], cache=cache, position_ids=position, use_cache=True)
                logits.append(out.logits[:, -1])
                token = logits[-1].argmax(-1)
                tokens.append(int(token))
    finally:
        for handle in handles:
            handle.remove()
    return tokens, logits


REPRESENTATIVE = {
    "snapkv": lambda: snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL),
    "adakv": lambda: snapkv.build_config("adakv", budget=None, ratio=0.5),
    "expected_attention": lambda: snapkv.build_config("expected_attention", budget=None, ratio=0.5),
    "streamingllm": lambda: snapkv.build_config("streamingllm", budget=BUDGET),
    "critical_adakv": lambda: snapkv.build_config("critical_adakv", budget=None, ratio=0.5),
}


@pytest.mark.parametrize("name", sorted(READ))
def test_greedy_tokens_on_each_cache_equal_the_models_own(name):
    """SnapKV, AdaKV (each head its own count), Expected Attention (its RoPE statistics), StreamingLLM and
    CriticalAdaKV (values weighed by the output projection): the tokens and every step's logits (float32, 1e-4)."""
    model = build(READ[name])
    ids = prompt()
    settings = {method: make() for method, make in REPRESENTATIVE.items()}
    for method, cfg in settings.items():
        if method == "expected_attention" and name == "stablelm":  # RoPE on a slice the module cuts itself
            with pytest.raises(snapkv.InputError, match="^model_type='stablelm': its attention rotates a slice"):
                with torch.no_grad(), snapkv.compress(model, cfg):
                    model(ids)
            continue
        with torch.no_grad(), snapkv.compress(model, cfg) as session:
            out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                                 output_logits=True, return_dict_in_generate=True)
            kept = snapkv.kept_positions(session.caches[0])
        tokens, logits = tokens_attending_to(model, ids, kept, STEPS)
        assert out.sequences[0, LENGTH:].tolist() == tokens, f"{name}: {method}"
        torch.testing.assert_close(torch.cat(out.logits), torch.cat(logits), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, method=method: f"{name}: {method}: {m}")
    want = official_selection(model, ids, "mean")
    with torch.no_grad(), snapkv.compress(model, settings["snapkv"]) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        got = kept_array(session.caches[0], LENGTH)
    assert (got == want).mean() > 0.98, name  # the per-KV-head vote too (ties aside)


@pytest.mark.parametrize("name", sorted(n for n in READ if not READ[n].sliding))
def test_kvzip_and_think_caches_decode_as_the_model_attends(name, smol_tokenizer):
    """KVzip (its replay through the model, each head its own count) and ThinK (the prompt's keys keep half their
    channels): the tokens and every step's logits equal the model's own over the kept positions (for ThinK: its
    pruned channels zeroed, as kvpress's ``ThinKPress`` leaves them)."""
    vocab = len(smol_tokenizer)
    model, ids = build(READ[name], vocab_size=vocab), prompt(vocab)
    for cfg in (snapkv.build_config("kvzip", budget=None, ratio=0.5),
                snapkv.build_config("think", budget=None, ratio=0.0, key_channel_ratio=0.5)):
        with torch.no_grad(), snapkv.compress(model, cfg, tokenizer=smol_tokenizer) as session:
            out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                                 output_logits=True, return_dict_in_generate=True)
            cache = session.caches[0]
        kept = snapkv.kept_positions(cache)
        dropped = {idx: layer.dropped[0] for idx, layer in enumerate(cache.layers) if hasattr(layer, "dropped")}
        assert bool(dropped) == (cfg.method == "think")
        tokens, logits = tokens_attending_to(model, ids, kept, STEPS, dropped)
        assert out.sequences[0, LENGTH:].tolist() == tokens, f"{name}: {cfg.method}"
        torch.testing.assert_close(torch.cat(out.logits), torch.cat(logits), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, method=cfg.method: f"{name}: {method}: {m}")


@pytest.mark.parametrize("name", sorted(READ))
def test_expected_attentions_rotation_is_the_layers_own(name):
    """``rotation_matrices`` (the basis of Expected Attention's averaged RoPE) times the queries before RoPE equals the
    module's own queries after it, on every layer: partial, interleaved, absent RoPE included."""
    model = build(READ[name])
    seen = {}

    def keep(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                                  kwargs["position_embeddings"])
    handles = [attention_of(layer).register_forward_pre_hook(keep, with_kwargs=True)
               for layer in model.base_model.layers]
    with torch.no_grad():
        model(prompt()[:, :16])
    for handle in handles:
        handle.remove()
    for idx, layer in enumerate(model.base_model.layers):
        attn = attention_of(layer)
        hidden, (cos, sin) = seen[idx]
        if reading(attn).rope_width != reading(attn).head_dim:  # refused where used (the tokens test)
            continue
        with torch.no_grad():
            own = module_call(attn, hidden, (cos, sin)).query                 # [1, H, n, d]
            before = prerope_queries(attn, hidden)
            rotations = rotation_matrices(attn, cos[0], sin[0])               # [n, d, d]
        ours = torch.einsum("nij,bhnj->bhni", rotations, before)
        torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-5, msg=f"{name} layer {idx}")


@pytest.mark.parametrize("name", sorted(n for n in READ if READ[n].sliding))
def test_sliding_layers_can_be_compressed_within_their_window(name):
    """``compress_sliding=True``: a sliding layer keeps SnapKV's budget out of its window's positions only."""
    model = build(READ[name])
    cfg = snapkv.SnapKV(budget=24, window=WINDOW, kernel=KERNEL)
    with torch.no_grad(), snapkv.compress(model, cfg, compress_sliding=True) as session:
        model(prompt(), cache=DynamicCache(config=model.config), use_cache=True)
        kept = snapkv.kept_positions(session.caches[0])
    for idx, per_row in enumerate(kept):
        window = sliding(model, idx)
        for positions in per_row[0]:
            assert len(positions) == 24
            if window is not None:
                assert int(positions.min()) > LENGTH - window


@pytest.mark.parametrize("name", sorted(READ))
def test_what_a_family_refuses_is_what_its_record_says(name):
    """``Family.limits`` (the docs' table): re-rotated keys, a method applying RoPE itself and KVzip are refused in
    one line where the record says so, and run elsewhere."""
    family, model, ids = READ[name], build(READ[name]), prompt()
    finch = snapkv.build_config("finch", budget=None, ratio=0.5)
    expected = snapkv.build_config("expected_attention", budget=None, ratio=0.5)
    kvzip = snapkv.build_config("kvzip", budget=None, ratio=0.5)
    for cfg, refused, match in ((finch, "re-rotated keys" in family.limits, "^finch: re-rotated keys"),
                                (expected, "applying RoPE itself" in family.limits, "^model_type=.*rotates a slice"),
                                (kvzip, "KVzip" in family.limits, "^kvzip: its replay")):
        if refused:
            with pytest.raises(snapkv.InputError, match=match) as error:
                with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=8):
                    model(ids)
            assert "\n" not in str(error.value)
        elif cfg is not kvzip:  # (KVzip's replay needs a tokenizer: tests/test_kvzip.py)
            with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=8) as session:
                model(ids, cache=DynamicCache(config=model.config), use_cache=True)
            assert session.cache_lengths


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_family_read_otherwise_is_refused_in_one_line(name):
    family = REFUSED[name]
    model = build(family)
    with pytest.raises(ValueError, match=f"^model_type='{family.model_type}'.*{family.refused}") as refused:
        snapkv.compress(model, snapkv.SnapKV(budget=BUDGET, window=WINDOW)).__enter__()
    assert "\n" not in str(refused.value)


def prefilled(model, cfg, ids):
    """Inside ``snapkv.compress(model, cfg)``: the prompt's compressed cache (the session still attached)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("name", ["gemma2", "mistral-sliding"])
def test_several_tokens_at_once_on_sliding_layers_equal_one_at_a_time(name):
    """A continuation of several tokens on a compressed cache whose sliding layers hold their window: each new token
    sees only the window behind it, as when the tokens come one by one."""
    model, ids = build(READ[name]), prompt()
    new = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL)
    with snapkv.compress(model, cfg), torch.no_grad():
        together = model(new, cache=prefilled(model, cfg, ids), use_cache=True).logits
        cache = prefilled(model, cfg, ids)
        apart = torch.cat([model(new[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(5)], dim=1)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_a_decoding_cut_leaves_sliding_layers_to_the_model():
    """A setting that cuts while decoding cuts the full-attention layers; the sliding ones keep their window."""
    model = build(READ["gemma2"])
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL, decode_target=BUDGET, decode_interval=WINDOW)
    with torch.no_grad(), snapkv.compress(model, cfg) as session:
        model.generate(prompt(), max_new_tokens=2 * WINDOW + 1, do_sample=False, min_new_tokens=2 * WINDOW + 1)
        cache = session.caches[0]
    window = READ["gemma2"].tiny["sliding_window"]
    assert state_of(cache).decoding_cuts == 2  # the one full-attention layer, twice
    assert [layer.keys.shape[-2] for layer in cache.layers] == [window - 1, BUDGET, window - 1]


def test_what_cannot_follow_sliding_layers_is_refused_in_one_line():
    model = build(READ["gemma2"])
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt()[:, 4:]], dim=1)
    mask = (padded != 0).long()
    with snapkv.compress(model, cfg), torch.no_grad():
        with pytest.raises(snapkv.InputError, match="^snapkv: a left-padded batch cannot be compressed on a model "
                                                    "with sliding-window layers"):
            model(padded, attention_mask=mask, cache=DynamicCache(config=model.config), use_cache=True)
        with pytest.raises(snapkv.InputError, match="^caches: a cache with the model's sliding-window layers"):
            snapkv.merge_caches([prefilled(model, cfg, prompt()), prefilled(model, cfg, prompt())])


@pytest.mark.parametrize("name", sorted(READ))
def test_the_planner_counts_the_cache_each_family_holds(name):
    """``snapkv.memory.plan``'s ``kv_cache_bytes`` for the prompt equals the bytes the session's cache holds: the
    compressed full-attention layers, the sliding layers' windows (MoE and fused projections change no cache)."""
    from snapkv.memory import plan
    model, ids = build(READ[name]), prompt()
    for cfg in (snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL), None):
        with torch.no_grad(), snapkv.compress(model, cfg or snapkv.build_config("full")) as session:
            model(ids, cache=DynamicCache(config=model.config), use_cache=True)
            held = sum(t.numel() * t.element_size() for layer in session.caches[0].layers
                       for t in (layer.keys, layer.values))
        planned = plan(model.config, LENGTH, cfg, dtype="float32", device="cpu")["kv_cache_bytes"]
        assert planned == held, f"{name}: {cfg}"


@pytest.mark.parametrize("config", ["command-r", "gemma-3-12b-it", "phi-4-mini", "gpt-oss-20b", "olmo-2-7b",
                                    "smollm3-3b"])
def test_each_family_config_is_planned_with_its_sliding_layers(config):
    """conf/model's family configs: their architecture block is a transformers config the planner counts (a sliding
    layer holds its window, a window no shorter than the context is none), nothing refused."""
    from omegaconf import OmegaConf

    from snapkv.memory import Shape, plan
    architecture = OmegaConf.to_container(OmegaConf.load(f"conf/model/{config}.yaml"))["architecture"]
    shape = Shape.of(architecture)
    sliding = {"gemma-3-12b-it": 40, "gpt-oss-20b": 12}.get(config, 0)
    assert shape.layers - len(shape.full_layers) == sliding
    snap = plan(architecture, 100_000, snapkv.SnapKV(budget=1024))
    full = plan(architecture, 100_000, None)
    window = max(shape.windows, default=0)
    per_token = 2 * shape.kv_heads * shape.head_dim * 2  # keys and values, bfloat16
    assert snap["kv_cache_bytes"] == per_token * (len(shape.full_layers) * 1024 + sliding * (window - 1))
    assert full["kv_cache_bytes"] == per_token * (len(shape.full_layers) * 100_000 + sliding * (window - 1))


@pytest.mark.parametrize("name", sorted(READ))
def test_the_chunked_prefill_keeps_and_writes_what_one_pass_does_with_sdpa(name):
    """With sdpa (where the family takes it): chunks of 32 keep the positions and write the tokens of the model's own
    one-pass prefill (a sliding layer's chunks take its window's mask; a plain one splits at the chunk)."""
    family = READ[name]
    config = AutoConfig.for_model(family.model_type, **{**COMMON, **family.tiny})
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    except ValueError as error:
        pytest.skip(f"{name}: {error}"[:120])  # Gemma 2, gpt-oss: eager only
    runs = []
    for chunk in (None, 32):
        with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL),
                                              prefill_chunk=chunk) as session:
            out = model.generate(prompt(), max_new_tokens=4, do_sample=False, min_new_tokens=4)
            kept = [[p.tolist() for p in layer[0]] for layer in snapkv.kept_positions(session.caches[0])]
        runs.append((out[0, LENGTH:].tolist(), kept))
    assert runs[0] == runs[1]


def test_the_family_sweep_tells_exact_held_refused_and_wrong_apart(monkeypatch):
    """scripts/family_sweep.py (every causal-LM family transformers ships; docs/library.md gives its last counts):
    its verdicts on known families, and a selection that is off is reported wrong."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("family_sweep", "scripts/family_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sweep.in_child("llama")["outcome"] == "exact"
    assert sweep.in_child("gemma2")["outcome"] == "exact"      # its full-attention layer; the others held
    assert sweep.in_child("afmoe")["outcome"] == "held"        # every layer slides over more than the prompt
    refused = sweep.in_child("bloom")
    assert refused["outcome"] == "refused" and refused["detail"].startswith("model_type='bloom' is not supported")
    monkeypatch.setattr(sweep, "official_kept", lambda weights, layer: [set()] * weights[layer].shape[1])
    assert sweep.in_child("llama")["outcome"] == "wrong"
