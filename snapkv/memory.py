"""Memory planner: predict prefill/decode peak memory from a model config alone (no weights).

The model is a sum of named terms, so a plan shows where memory goes: weights (dense or
mixture-of-experts), the KV cache held at the end of prefill, the KV held while the last layer
runs, and the largest per-layer transient of a prefill: hidden states, one layer's q/k/v and
attention (eager: the L x L scores in the model dtype plus their float32 softmax, and the additive
mask; fused kernels: tiles), the MLP activations (a MoE layer runs its routed experts' MLPs and a shared expert), the
compression step (beside the layer's query states: each method's own term,
``Method.compression_bytes``, from the helpers
here, e.g. ``window_scores_bytes``; plus, with ``gqa="repeat"``, a repeated copy of one layer's K and
V), and the last-position logits.

A left-padded batch (``padded=True``: prompts of different lengths in flight) adds the batch x L x L
mask transformers builds for sdpa (boolean; eager's additive mask is planned anyway). Not planned:
the runtime's own buffers (CUDA context, cuBLAS workspaces, CPU thread pools); ``eval.bench``
measures above a model that has run one token, so those are outside its numbers too.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .families import FAMILIES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# every family the compressor reads (snapkv.families), and Qwen2-MoE (Qwen2's attention, a shared expert)
PLANNED = tuple(sorted({family.model_type for family in FAMILIES if not family.refused} | {"qwen2_moe"}))
_SELECTION_CHUNK = 256 * 2**20  # snapkv.select: window x L float32 per chunk of heads
# tokens per chunk of a session's prefill (``snapkv.prefill``, which takes it from here): the chunk's activations
# (its MLP's above all) are fixed-size buffers; the mask of a chunk's queries over the keys so far (sdpa with
# padding, eager) is chunk x L, so a smaller chunk holds less per prompt token, a larger one launches fewer kernels
PREFILL_CHUNK = 2048


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int        # a dense MLP's, or one expert's
    vocab: int
    experts: int             # routed experts per MoE layer (1: dense)
    active_experts: int      # experts each token runs
    shared_intermediate: int  # a shared expert's (Qwen2-MoE), 0 if none
    tied: bool
    device: str = "cuda"     # where it runs: a method may size its chunks by device (H2O)
    windows: tuple = ()      # per layer: its sliding window (0: full attention); () every layer full

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @property
    def full_layers(self) -> list[int]:
        """The layers a session compresses: every one but the sliding-window layers (they hold their window)."""
        return [layer for layer in range(self.layers) if not self.window(layer)]

    @classmethod
    def of(cls, config, device: str = "cuda") -> "Shape":
        model_type = _get(config, "model_type")
        if model_type is not None and model_type not in PLANNED:
            raise InputError(f"model_type={model_type!r}: the memory planner knows {', '.join(PLANNED)}; "
                             "a plan for another architecture would be a wrong number")
        if isinstance(config, dict) and model_type is not None:  # a model config's architecture block: its layer
            config = _transformers_config(config)               # types as transformers derives them
        hidden, heads = int(_get(config, "hidden_size")), int(_get(config, "num_attention_heads"))
        experts = int(_get(config, "num_local_experts", None) or _get(config, "num_experts", None) or 1)
        moe = experts > 1
        intermediate = int(_get(config, "moe_intermediate_size", None) or _get(config, "intermediate_size")) if moe \
            else int(_get(config, "intermediate_size"))
        return cls(layers=int(_get(config, "num_hidden_layers")), hidden=hidden, heads=heads,
                   kv_heads=int(_get(config, "num_key_value_heads", heads) or heads),
                   head_dim=int(_get(config, "head_dim", None) or hidden // heads),
                   intermediate=intermediate, vocab=int(_get(config, "vocab_size")), experts=experts,
                   active_experts=int(_get(config, "num_experts_per_tok", 1) or 1) if moe else 1,
                   shared_intermediate=int(_get(config, "shared_expert_intermediate_size", 0) or 0),
                   tied=bool(_get(config, "tie_word_embeddings", False)), device=str(device),
                   windows=sliding_windows(config))

    def parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate * self.experts
        if self.experts > 1:
            mlp += self.hidden * self.experts  # the router
            if self.shared_intermediate:
                mlp += 3 * self.hidden * self.shared_intermediate + self.hidden  # shared expert and its gate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + embed + self.hidden

    def mlp_activations(self, tokens: int, nbytes: int) -> int:
        """Gate, up and their product for ``tokens`` (MoE: each token's routed experts, the shared one)."""
        per_token = 3 * self.intermediate * self.active_experts + 3 * self.shared_intermediate
        routing = tokens * self.experts * 4 * 2 if self.experts > 1 else 0  # router logits and weights
        return tokens * per_token * nbytes + routing


def _transformers_config(architecture: dict):
    from transformers import AutoConfig
    fields = {k: v for k, v in architecture.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(architecture["model_type"], **fields)
    except (TypeError, ValueError) as error:
        raise InputError(f"architecture: model_type={architecture['model_type']!r} does not take these fields "
                         f"({error})") from None


def sliding_windows(config) -> tuple:
    """Per layer, the sliding window its attention keeps (0: full attention), as transformers builds the model's
    own cache (``layer_types``, else a ``sliding_window`` every layer uses); a window no shorter than the model's
    context is none (Phi-4-mini's 262,144 of 131,072)."""
    window = _get(config, "sliding_window", None)
    layers = int(_get(config, "num_hidden_layers"))
    context = _get(config, "max_position_embeddings", None)
    if not window or (context and window >= context):
        return ()
    types = _get(config, "layer_types", None)
    if types is None:
        if _get(config, "use_sliding_window", True) is False:
            return ()
        types = ["sliding_attention"] * layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in types[:layers])


def softmax_bytes(nbytes: int) -> int:
    """Bytes per attention entry while a float32 softmax is taken and cast back: the scores, the
    float32 result and (below float32) its cast to the model dtype."""
    return nbytes + 4 + (nbytes if nbytes != 4 else 0)


def kv_bytes(shape: Shape, tokens_per_layer: list[int], heads: int, batch: int, nbytes: int,
             key_channels: int | None = None) -> int:
    """Keys and values of ``tokens_per_layer`` tokens per head, each key of ``key_channels`` channels (default
    ``head_dim``; fewer where a method stores fewer key channels, ``Method.stored_key_channels``)."""
    key_dim = shape.head_dim if key_channels is None else key_channels
    return sum(batch * heads * t * (key_dim + shape.head_dim) * nbytes for t in tokens_per_layer)


def channel_index_bytes(s: Shape, key_channels: int, batch: int) -> int:
    """Per layer, the int64 index of the channels a layer storing fewer key channels keeps and drops
    (``snapkv.channels``: ``head_dim`` indices per row and KV head); 0 where every channel is kept."""
    return batch * s.kv_heads * s.head_dim * 8 if key_channels < s.head_dim else 0


def repeated_kv_bytes(s: Shape, gqa: str, length: int, batch: int, nbytes: int) -> int:
    """``gqa="repeat"`` (any method): one layer's K and V repeated to every query head (none for MHA: one query
    head a KV head already)."""
    return 2 * batch * s.heads * length * s.head_dim * nbytes if gqa == "repeat" and s.heads != s.kv_heads else 0


def window_scores_bytes(s: Shape, window: int, length: int, batch: int, nbytes: int) -> int:
    """The observation-window vote of SnapKV and PyramidKV (``snapkv.select.window_attention``): the
    window's queries, the window x L scores (scaled in place), their float32 softmax and its cast of a chunk
    of KV heads at a time, then the votes: their sum and mean over the window per chunk of heads and each
    concatenated, the pooled copy and its reduction over each KV group (six float32 values per head and position
    at most; pinned by ``tests/test_prefill_memory.py``)."""
    queries = batch * s.heads * window * s.head_dim * nbytes
    group = s.heads // s.kv_heads
    per_kv_head = batch * group * window * length
    chunk = max(1, min(s.kv_heads, _SELECTION_CHUNK // max(per_kv_head * 4, 1)))
    return queries + chunk * per_kv_head * softmax_bytes(nbytes) + batch * s.heads * length * 4 * 6


def votes_bytes(s: Shape, length: int, batch: int) -> int:
    """One float32 vote per KV head and position (a method that computes no attention)."""
    return batch * s.kv_heads * length * 4


def compression_transient(s: Shape, compressor, length: int, batch: int, nbytes: int) -> int:
    """Bytes the compression of one layer allocates beside that layer's full K/V: the method's own
    term (``Method.compression_bytes``) and the copy ``gqa="repeat"`` makes."""
    return (compressor.compression_bytes(s, length, batch, nbytes)
            + repeated_kv_bytes(s, compressor.gqa, length, batch, nbytes))


def plan(config, length: int, compressor=None, batch: int = 1, dtype: str = "bfloat16",
         attn_implementation: str = "sdpa", mlp_chunk: int | None = None, decode_tokens: int = 0,
         device: str = "cuda", padded: bool = False, prefill_chunk: int | None = PREFILL_CHUNK,
         question_tokens: int | None = None) -> dict:
    """Predicted bytes by term, and ``peak_bytes`` (the largest of the prefill and decode peaks).
    ``prefill_chunk``: the session's chunked prefill (``snapkv.prefill``, the default), None: the model's own
    one-pass prefill; ``question_tokens``: the question's length, for a method reading it (FINCH)."""
    if dtype not in DTYPE_BYTES:
        raise InputError(f"dtype={dtype!r} is not allowed; choose one of {', '.join(DTYPE_BYTES)}")
    s, n = Shape.of(config, device), DTYPE_BYTES[dtype]
    compresses = compressor is not None and compressor.compresses
    heads = s.heads if compresses and compressor.gqa == "repeat" else s.kv_heads
    full = s.full_layers
    kept = [compressor.stored_tokens(i, s.layers, length, heads) if compresses else length for i in full] or [0]
    one_layer_full = kv_bytes(s, [length], s.kv_heads, batch, n)
    # the sliding-window layers hold their window's last tokens (the model's own sliding cache), whatever the setting
    windows = [min(length, s.window(i) - 1) for i in range(s.layers) if s.window(i)]
    sliding = kv_bytes(s, windows, s.kv_heads, batch, n)
    # the prompt's keys of a method storing fewer key channels (ThinK) keep only those, beside their index
    key_dim = compressor.stored_key_channels(s.head_dim) if compresses else s.head_dim
    index = channel_index_bytes(s, key_dim, batch)
    compressed = kv_bytes(s, kept if full else [], heads if compresses else s.kv_heads, batch, n, key_dim)
    after_prefill = compressed + len(full) * index + sliding
    # KV the prefill holds while a layer runs: full KV of every full-attention layer, or the others as they are
    # kept plus that one at full length (the one keeping least: the largest sum; once compressed: what is kept)
    keeps_all = not compresses or compressor.scores_after_prefill
    window_least = min(kv_bytes(s, [w], s.kv_heads, batch, n) for w in windows) if windows else one_layer_full
    if keeps_all:  # a sliding layer's prefill holds its whole prompt until it keeps its window
        held = kv_bytes(s, [length] * len(full), s.kv_heads, batch, n) + sliding + one_layer_full - window_least
    else:
        least = min(([kv_bytes(s, [min(kept)], heads, batch, n, key_dim) + index] if full else []) + [window_least])
        held = after_prefill - least + one_layer_full
    held_after = held if keeps_all else after_prefill
    if prefill_chunk is None:
        transient = one_pass_transient(s, compressor if compresses else None, length, batch, n, attn_implementation,
                                       mlp_chunk, padded)
        transient_after = 0
    else:  # what a chunk holds beside the layer's full keys and values, and once they are compressed
        stored = kv_bytes(s, [max(kept)], heads, batch, n, key_dim) if compresses else 0
        transient, transient_after = chunked_transient(s, compressor if compresses else None, length, batch, n,
                                                       attn_implementation, prefill_chunk, padded, question_tokens,
                                                       stored)
        transient_after += held_after - held
    weights = s.parameters() * n
    appended = decode_tokens
    if compresses and compressor.head_adaptive and decode_tokens:  # ragged layers append into doubling room
        from .ragged import room_after
        appended = room_after(decode_tokens)
    # decoded tokens: every full-attention layer appends them; a sliding layer grows to its window at most
    grown = kv_bytes(s, [min(length + decode_tokens, s.window(i) - 1) - min(length, s.window(i) - 1)
                         for i in range(s.layers) if s.window(i)], s.kv_heads, batch, n)
    decode_cache = after_prefill + grown + kv_bytes(s, [appended] * len(full), heads if compresses else s.kv_heads,
                                                    batch, n)
    if appended != decode_tokens:  # the room's last doubling: one layer's old buffer beside its new one
        decode_cache += kv_bytes(s, [max(kept) + appended // 2], heads, batch, n)
    if compresses and compressor.decodes and decode_tokens and full:
        decode_cache = decoding_cache_bytes(s, compressor, kept, length, decode_tokens, heads, batch, n) + sliding \
            + grown
    transient = max(transient, transient_after)
    prefill_peak = weights + held + transient
    decode_peak = weights + decode_cache + batch * s.vocab * 4 + 4 * batch * s.hidden * n
    return {"weights_bytes": weights, "kv_cache_bytes": after_prefill, "prefill_kv_held_bytes": held,
            "prefill_transient_bytes": transient, "prefill_peak_bytes": prefill_peak,
            "decode_peak_bytes": decode_peak, "peak_bytes": max(prefill_peak, decode_peak),
            "peak_above_weights_bytes": max(prefill_peak, decode_peak) - weights}


def last_chunk(length: int, chunk: int, rows_read: int | None) -> int:
    """The rows of a chunked prefill's last chunk (``snapkv.prefill.chunk_bounds``), its longest: ``chunk``, or the
    rows the settings read if more (``Method.prefill_rows``; None: every row), at most the prompt."""
    return length if rows_read is None else min(length, max(chunk, rows_read))


def chunk_rows(length: int, compressor, chunk: int, question_tokens: int | None = None) -> int:
    """The rows of the longest chunk of ``compressor``'s chunked prefill (``last_chunk``)."""
    return last_chunk(length, chunk, compressor.prefill_rows(length, question_tokens) if compressor is not None else 0)


def chunked_transient(s: Shape, compressor, length: int, batch: int, n: int, attn_implementation: str,
                      chunk: int, padded: bool, question_tokens: int | None = None,
                      stored: int = 0) -> tuple[int, int]:
    """What a chunked prefill (``snapkv.prefill``) holds beside the weights and the KV: the residual stream and the
    token and position ids of every position, and the largest of its phases on a chunk of ``c`` rows at the end of
    the prompt (its keys over every position):

    - attention: the normed rows, q/k/v, their RoPE'd copies and RoPE's temporaries, the attention's own buffers
      (``split_attention`` on a CPU with sdpa and no padding: the queries stacked by KV head, both halves' outputs
      and log-sum-exps, the chunk's own keys repeated to every query head, the float32 merge; elsewhere the chunk x
      L mask transformers builds, eager's chunk x L scores and float32 softmax, and sdpa's keys and values repeated
      to every query head where a mask keeps it off its GQA kernels), the output, its transposed copy, o_proj's;
    - MLP: the residual sum, the normed rows and the RMSNorm's float32 temporaries, the MLP's activations;
    - compression (after the last chunk's attention): the chunk's normed rows and attention output beside the
      method's term (``Method.compression_bytes``) or, after it, the layer's kept keys and values (``stored``)
      gathered while its full ones are still held, and a kept q_proj output for a method reading every query;
    - the end: the final norm's float32 temporaries and the last position's logits.

    Returns the largest beside the layer's full keys and values (every chunk's attention and compression, and the
    MLP of every chunk but the last) and the largest after its compression (the last chunk's MLP, the end)."""
    c = chunk_rows(length, compressor, chunk, question_tokens)
    rows, hidden, d = batch * c, s.hidden, s.head_dim
    q_width, kv_width = s.heads * d, s.kv_heads * d
    residual = batch * length * hidden * n + batch * length * 8 + length * 8 + (batch * length * 8 if padded else 0)
    normed = rows * hidden * n + 2 * rows * d * n  # the chunk's normed rows (and its cos and sin)
    # RoPE: q, k, v beside q * cos, rotate_half(q) and its product with sin; then k's, beside q's result
    rope = normed + rows * (q_width + 2 * kv_width) * n + rows * max(3 * q_width, q_width + 3 * kv_width) * n
    grouped = s.heads != s.kv_heads
    if attn_implementation == "sdpa" and s.device == "cpu" and not padded:  # split_attention
        attention = rows * q_width * (2 * n + 2 * 4)  # both halves' outputs, the float32 merge's two terms
        if grouped:
            attention += 3 * rows * q_width * n  # the queries stacked by KV head, the chunk's keys repeated
    else:
        attention = rows * q_width * n + batch * c * length * (n if attn_implementation == "eager" else 1)
        if attn_implementation == "eager":
            attention += batch * s.heads * c * length * softmax_bytes(n)
        elif grouped and attn_implementation == "sdpa" and (padded or length > c):
            attention += 2 * batch * s.heads * length * d * n  # repeated keys and values: a mask keeps GQA off
    attention_phase = max(rope, normed + rows * q_width * n + attention)
    # the residual sum and its norm, then gate/up/their product (the norm's float32 temporaries are fewer)
    mlp_phase = 2 * normed + max(s.mlp_activations(rows, n), rows * hidden * 4 * 2)
    compression_phase = 0
    if compressor is not None:  # after the last chunk's attention: its normed rows and o_proj output
        kept_queries = rows * q_width * n if compressor.reads_every_query or compressor.needs_attention_weights else 0
        # the scoring, then the gather of what is kept (the scores freed by then)
        compression_phase = 2 * normed + kept_queries + max(compression_transient(s, compressor, length, batch, n),
                                                            stored)
    end = rows * hidden * 4 * 2 + batch * s.vocab * 4
    if c >= length:  # one chunk: its MLP runs once the layer is compressed
        return residual + max(attention_phase, compression_phase), residual + max(mlp_phase, end)
    return residual + max(attention_phase, mlp_phase, compression_phase), residual + end


def one_pass_transient(s: Shape, compressor, length: int, batch: int, n: int, attn_implementation: str,
                       mlp_chunk: int | None, padded: bool) -> int:
    """What the model's own one-pass prefill holds beside the weights and the KV (``prefill_chunk=None``), the
    estimate this planner made before the chunked prefill (not pinned by a measurement: it leaves out RoPE's
    temporaries and the concatenated copy of the layer's keys and values, about 10% of an LWM-7B prefill): the
    embedding output, the residual and the normed sequence, and the largest of: q/k/v over every position and the
    attention (eager: the L x
    L scores and their float32 softmax, beside the additive L x L mask; fused kernels: tiles; a padded batch: the
    boolean L x L mask sdpa is given); the MLP's activations (of ``mlp_chunk`` rows where set); the compression
    beside the layer's query states; then the last position's logits."""
    rows = min(length, mlp_chunk) if mlp_chunk else length
    hidden = 3 * batch * length * s.hidden * n
    qkv = batch * length * (s.heads + 2 * s.kv_heads) * s.head_dim * n + batch * length * s.heads * s.head_dim * n
    if attn_implementation == "eager":
        scores = batch * s.heads * length * length * softmax_bytes(n) + batch * length * length * n
    else:
        scores = batch * s.heads * min(length, 1024) * 4 * 2  # fused kernels: tiles, not L x L
        if padded:
            scores += batch * length * length  # the boolean padding mask transformers builds for sdpa
    mlp = s.mlp_activations(batch * rows, n)
    logits = batch * s.vocab * 4
    queries = batch * length * s.heads * s.head_dim * n
    selection = queries + compression_transient(s, compressor, length, batch, n) if compressor is not None else 0
    return hidden + max(qkv + scores, mlp, selection) + logits


def decoding_cache_bytes(s: Shape, compressor, kept: list[int], length: int, decode_tokens: int, heads: int,
                         batch: int, n: int) -> int:
    """The cache's largest size while a setting cutting while decoding (``Method.decodes``) writes
    ``decode_tokens`` tokens: per layer, never more than its prompt's cache or the target, plus one interval
    (``min(kept + tokens, max(kept, target) + interval)``), beside one layer's kept copy at a cut and every
    layer's buffer of hidden states (the last ``decode_buffer`` tokens and the current one). A head-adaptive
    setting's layers hold each head's own slots (``snapkv.ragged``): the tokens appended after a cut go into
    room that doubles; where its ``keep`` reads the values (CriticalAdaKV), a cut also holds one row's values
    padded to its longest head, at most every slot of the layer."""
    from .ragged import room_after
    interval = compressor.decode_interval
    target = compressor.decoding_target(length + decode_tokens)  # a ratio's target grows with the sequence
    grown = room_after if compressor.head_adaptive else (lambda tokens: tokens)
    peaks = [min(k + grown(decode_tokens), max(k, target) + grown(min(interval, decode_tokens))) for k in kept]
    held = kv_bytes(s, peaks, heads, batch, n)
    copy = kv_bytes(s, [min(target, max(peaks))], heads, batch, n)
    if compressor.head_adaptive and getattr(compressor, "keep_reads_values", False):
        copy += kv_bytes(s, [heads * max(peaks)], heads, 1, n) // 2
    buffered = len(kept) * batch * min(compressor.decode_buffer + 1, interval) * s.hidden * n
    return held + copy + buffered


def longest_fitting(config, memory_bytes: int, compressor=None, limit: int = 4_194_304, **kwargs) -> int:
    """The longest input (tokens) whose predicted peak fits in ``memory_bytes`` (0 if none does)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(config, mid, compressor, **kwargs)["peak_bytes"] <= memory_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_shared(config, length: int, compressors: list, batch: int = 1, dtype: str = "bfloat16",
                attn_implementation: str = "sdpa", mlp_chunk: int | None = None, decode_tokens: int = 0,
                decode_together: bool = False, device: str = "cuda", padded: bool = False,
                prefill_chunk: int | None = PREFILL_CHUNK) -> dict:
    """A shared prefill of several settings (``snapkv.compress(model, [a, b, ...])``): every kept cache
    plus the largest transient. While the last layer runs, each setting holds its earlier layers as it
    keeps them and that layer's full KV is held once; the settings score one after another, so the
    transient is the largest one setting has. Decoding starts with every setting's cache alive (each is
    freed once it has decoded). ``decode_together``: the settings decode as one batch
    (``snapkv.merge_caches``), every row padded to the largest cache, with a row of logits each (the
    bound when every setting shares one batch)."""
    if not compressors:
        raise InputError("compressors=[]: plan at least one setting")
    kw = dict(batch=batch, dtype=dtype, attn_implementation=attn_implementation, mlp_chunk=mlp_chunk,
              decode_tokens=decode_tokens, device=device, padded=padded, prefill_chunk=prefill_chunk)
    plans = [plan(config, length, c if c is not None and c.compresses else None, **kw) for c in compressors]
    s, n = Shape.of(config), DTYPE_BYTES[dtype]
    one_layer_full = kv_bytes(s, [length], s.kv_heads, batch, n)
    weights = plans[0]["weights_bytes"]
    kept = sum(p["kv_cache_bytes"] for p in plans)
    held = sum(p["prefill_kv_held_bytes"] - one_layer_full for p in plans) + one_layer_full
    transient = max(p["prefill_transient_bytes"] for p in plans)
    prefill_peak = weights + held + transient
    decode_peak = max(p["decode_peak_bytes"] + kept - p["kv_cache_bytes"] for p in plans)
    if decode_together:
        widest = max(plans, key=lambda p: p["decode_peak_bytes"])
        decode_peak = len(plans) * (widest["decode_peak_bytes"] - weights) + weights
    return {"weights_bytes": weights, "kv_cache_bytes": kept, "prefill_kv_held_bytes": held,
            "prefill_transient_bytes": transient, "prefill_peak_bytes": prefill_peak,
            "decode_peak_bytes": decode_peak, "peak_bytes": max(prefill_peak, decode_peak),
            "peak_above_weights_bytes": max(prefill_peak, decode_peak) - weights,
            "settings": len(compressors)}
