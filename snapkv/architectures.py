"""Which transformers models the compressor drives, and how it reads their attention modules."""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from .errors import InputError

# the families tests/test_families.py reads exactly as the model attends (and the MoE variants of two of them)
TESTED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "granite", "cohere", "olmo",
          "starcoder2", "smollm3")


def decoder_layers(model) -> list:
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise InputError(f"model_type={model.config.model_type!r} is not supported: no decoder layers found; "
                         f"supported: {', '.join(TESTED)}")
    return list(layers)


@contextmanager
def replaced_forwards(modules, replacement):
    """Each module's ``forward`` is ``replacement(module, its forward)`` while the context lasts, as an
    instance attribute; afterwards the class's ``forward`` is back."""
    modules = list(modules)
    for module in modules:
        module.forward = replacement(module, module.forward)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


# families whose attention rotates queries and keys on some layers only, with no attribute saying which (Cohere2:
# its full-attention layers apply no RoPE): queries read with RoPE there would select wrongly
ROPE_ON_SLIDING_LAYERS_ONLY = ("cohere2",)


def check_supported(model) -> None:
    """Fail loudly for a model whose attention the compressor cannot read exactly (never a silently wrong
    selection): a module unlike the Llama family's, layers without RoPE, a query norm over the whole projection."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    supported = ", ".join(TESTED)
    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "head_dim", "layer_idx", "num_key_value_groups")
        if attn is None or not all(hasattr(attn, n) for n in needed) or rope_function(attn) is None:
            raise InputError(f"model_type={model_type!r} is not supported (its attention module differs from "
                             f"the Llama family's); supported: {supported}")
        if not getattr(attn, "use_rope", True) or (model_type in ROPE_ON_SLIDING_LAYERS_ONLY
                                                   and getattr(attn, "sliding_window", None) is None):
            raise InputError(f"model_type={model_type!r} is not supported: layer {attn.layer_idx} applies no RoPE "
                             "(SmolLM3's no_rope_layers, Cohere2's full-attention layers), which the compressor's "
                             f"queries assume; supported: {supported}")
        norm = getattr(getattr(attn, "q_norm", None), "weight", None)
        if norm is not None and norm.shape[-1] != attn.head_dim:
            raise InputError(f"model_type={model_type!r} is not supported: its q_norm normalises the whole "
                             f"{norm.shape[-1]}-wide query projection (OLMo-2), not each head of {attn.head_dim}; "
                             f"supported: {supported}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = any(t != "full_attention" for t in layer_types)
    else:
        sliding = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
    if sliding:
        raise InputError(f"model_type={model_type!r} with sliding-window layers (sliding_window="
                         f"{config.sliding_window}) is not supported: the compressor would keep positions those layers "
                         "never attend to (Mistral v0.2 and later have none)")


def rope_function(attn):
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def window_queries(attn, hidden_states: torch.Tensor, position_embeddings, n: int,
                   projected: torch.Tensor | None = None) -> torch.Tensor:
    """Post-RoPE query states ``[b, H, n, d]`` of the last ``n`` positions, as the module computes them."""
    return queries_at(attn, hidden_states, position_embeddings, slice(-n, None), projected)


def queries_at(attn, hidden_states: torch.Tensor, position_embeddings, rows: slice,
               projected: torch.Tensor | None = None) -> torch.Tensor:
    """Post-RoPE query states ``[b, H, n, d]`` of the positions ``rows``, as the module computes them.
    ``projected``: the module's own ``q_proj`` output for every position, if kept (not computed again)."""
    hidden = hidden_states[:, rows]
    b = hidden.shape[0]
    q = projected[:, rows] if projected is not None else attn.q_proj(hidden)
    q = q.view(b, hidden.shape[1], -1, attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises queries per head before RoPE
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos[:, rows], sin[:, rows]
    q, _ = rope_function(attn)(q, q[:, :1], cos, sin)
    return q


def prerope_queries(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """Query states ``[b, H, n, d]`` of ``hidden_states`` before RoPE (after Qwen3's per-head norm):
    ``q_proj`` of exactly these rows, as kvpress's ``get_prerope_query_states`` computes them."""
    b, n, _ = hidden_states.shape
    q = attn.q_proj(hidden_states).view(b, n, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    return q.transpose(1, 2)
