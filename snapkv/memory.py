"""Memory planner: predict prefill/decode peak memory from a model config alone (no weights).

The model is a sum of named terms, so a plan shows where memory goes: weights, the KV cache
held at the end of prefill, and the largest per-layer transient of a prefill (hidden states,
one layer's q/k/v, the attention scores, the MLP activations, the last-position logits).
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int
    tied: bool

    @classmethod
    def of(cls, config) -> "Shape":
        hidden, heads = int(_get(config, "hidden_size")), int(_get(config, "num_attention_heads"))
        return cls(layers=int(_get(config, "num_hidden_layers")), hidden=hidden, heads=heads,
                   kv_heads=int(_get(config, "num_key_value_heads", heads) or heads),
                   head_dim=int(_get(config, "head_dim", None) or hidden // heads),
                   intermediate=int(_get(config, "intermediate_size")), vocab=int(_get(config, "vocab_size")),
                   experts=int(_get(config, "num_local_experts", 1) or 1),
                   tied=bool(_get(config, "tie_word_embeddings", False)))

    def parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate * self.experts + self.hidden * self.experts
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + embed + self.hidden


def kv_bytes(shape: Shape, tokens_per_layer: list[int], heads: int, batch: int, nbytes: int) -> int:
    return sum(2 * batch * heads * t * shape.head_dim * nbytes for t in tokens_per_layer)


def plan(config, length: int, compressor=None, batch: int = 1, dtype: str = "bfloat16",
         attn_implementation: str = "sdpa", mlp_chunk: int | None = None, decode_tokens: int = 0) -> dict:
    """Predicted bytes by term, and ``peak_bytes`` (the largest of the prefill and decode peaks)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not allowed; choose one of {', '.join(DTYPE_BYTES)}")
    s, n = Shape.of(config), DTYPE_BYTES[dtype]
    compresses = compressor is not None and compressor.compresses
    heads = s.heads if compresses and compressor.gqa == "repeat" else s.kv_heads
    kept = [min(length, compressor.layer_budget(i, s.layers, length)) if compresses else length for i in range(s.layers)]
    one_layer_full = kv_bytes(s, [length], s.kv_heads, batch, n)
    after_prefill = kv_bytes(s, kept, heads if compresses else s.kv_heads, batch, n)
    rows = min(length, mlp_chunk) if mlp_chunk else length
    hidden = 3 * batch * length * s.hidden * n
    qkv = batch * length * (s.heads + 2 * s.kv_heads) * s.head_dim * n + batch * length * s.heads * s.head_dim * n
    if attn_implementation == "eager":
        # one L x L score tensor per head in the model dtype: the frontier the paper reports (~33K for
        # LWM-7B on 80 GB); a float32 softmax copy beside it would move the frontier lower
        scores = batch * s.heads * length * length * n
    else:
        scores = batch * s.heads * min(length, 1024) * 4 * 2  # fused kernels: tiles, not L x L
    mlp = 3 * batch * rows * s.intermediate * n * (1 if s.experts == 1 else 2)
    logits = batch * s.vocab * 4
    window = compressor.window if compresses else 0
    selection = batch * s.heads * max(window, 1) * length * 4 * 2 if compresses else 0
    transient = hidden + max(qkv + scores, mlp, selection) + logits
    # KV the prefill holds while the last layer runs: full KV of every layer, or the compressed
    # earlier layers plus the current one at full length.
    held = kv_bytes(s, [length] * s.layers, s.kv_heads, batch, n) if not compresses else \
        after_prefill - kv_bytes(s, [kept[-1]], heads, batch, n) + one_layer_full
    weights = s.parameters() * n
    decode_cache = after_prefill + kv_bytes(s, [decode_tokens] * s.layers, heads if compresses else s.kv_heads,
                                            batch, n)
    prefill_peak = weights + held + transient
    decode_peak = weights + decode_cache + batch * s.vocab * 4 + 4 * batch * s.hidden * n
    return {"weights_bytes": weights, "kv_cache_bytes": after_prefill, "prefill_kv_held_bytes": held,
            "prefill_transient_bytes": transient, "prefill_peak_bytes": prefill_peak,
            "decode_peak_bytes": decode_peak, "peak_bytes": max(prefill_peak, decode_peak),
            "peak_above_weights_bytes": max(prefill_peak, decode_peak) - weights}


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
