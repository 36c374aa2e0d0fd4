"""Which transformers models the compressor drives, and how it reads their attention modules.

Nothing here assumes a family's layout. What a method reads of a layer (its queries, before or after RoPE, and how
its scores become attention: scaling, soft-capping, sinks, a sliding window) is taken from the attention module's
own ``forward``, run on the rows asked for with transformers' attention function replaced by one that records its
inputs and stops (``module_call``): a fused ``qkv_proj`` (Phi-3), partial rotary (Phi-4-mini, GPT-NeoX), a query
norm over the whole projection (OLMo-2) or per head (Qwen3, Gemma 3), interleaved RoPE (Cohere), layers without
RoPE (SmolLM3, Cohere2), Granite's multiplier and Gemma's ``query_pre_attn_scalar`` arrive as the model computes
them. ``reading`` probes each module once: whether its attention goes through transformers' attention interface
(else it is refused), whether it rotates (``apply_rotary_pos_emb`` called), and its ``AttentionForm``."""
from __future__ import annotations

import inspect
import sys
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from .errors import InputError
from .families import FAMILIES

# the names an attention module or decoder takes its cache under (GPT-NeoX's attention: ``layer_past``)
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")
# the families tests/test_families.py pins against each model's own attention (snapkv.families: what each needed)
TESTED = tuple(sorted({family.model_type for family in FAMILIES if not family.refused}))


def decoder_layers(model) -> list:
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:  # a multimodal model's language model (Gemma 3's)
        layers = getattr(getattr(base, "language_model", None), "layers", None)
    if layers is None:
        raise InputError(f"model_type={model.config.model_type!r} is not supported: no decoder layers found "
                         f"(model.model.layers); supported: {', '.join(TESTED)}")
    return list(layers)


def attention_of(layer):
    """A decoder layer's attention module (``self_attn``; GPT-NeoX names it ``attention``), or None."""
    attn = getattr(layer, "self_attn", None)
    return attn if attn is not None else getattr(layer, "attention", None)


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


@dataclass(frozen=True)
class AttentionForm:
    """How a layer turns ``Q K^T`` into attention, as its module passes it to transformers' attention function:
    ``scaling`` (None: ``1/sqrt(d)``), tanh ``softcap`` of the scaled logits (Gemma 2), per-head ``sinks`` logits in
    the softmax's denominator (gpt-oss), and the ``sliding_window`` its keys are limited to (None: every key)."""

    scaling: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    sliding_window: int | None = None

    @property
    def plain(self) -> bool:
        """Whether the layer's softmax is the plain causal one over every key."""
        return self.softcap is None and self.sinks is None and self.sliding_window is None


@dataclass(frozen=True)
class ModuleReading:
    """What one attention module is, probed once (``reading``)."""

    form: AttentionForm
    rotates: bool       # whether it applies RoPE (its module's ``apply_rotary_pos_emb``) to queries and keys
    rope_width: int     # the channels of each head it hands that function (fewer than ``head_dim``: StableLM
    #                     rotates a slice it cuts itself)
    query_heads: int
    kv_heads: int
    head_dim: int       # of its queries and keys
    value_dim: int


@dataclass
class ModuleCall:
    """The tensors an attention module hands to transformers' attention function for some rows: queries
    ``[b, H, n, d]``, keys and values ``[b, Hkv, n, d]`` (after its norms and RoPE, if given positions)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    form: AttentionForm


class _Captured(Exception):
    def __init__(self, call: ModuleCall):
        super().__init__("captured")
        self.call = call


def _capture(module, query, key, value, attention_mask=None, **kwargs):
    sinks = kwargs.get("s_aux")
    window = kwargs.get("sliding_window")
    form = AttentionForm(kwargs.get("scaling"), kwargs.get("softcap") or None,
                         sinks.detach() if torch.is_tensor(sinks) else None, int(window) if window else None)
    raise _Captured(ModuleCall(query, key, value, form))


CAPTURE_ATTENTION = "snapkv_capture"


@contextmanager
def routed_to(module, name: str, function):
    """The module's attention through ``function`` (registered as ``name``) while the context lasts: transformers
    picks the attention function from the config at each call, so its name is switched around the call."""
    from transformers import AttentionInterface
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, function)
    own = module.config._attn_implementation
    module.config._attn_implementation = name
    try:
        yield
    finally:
        module.config._attn_implementation = own


class _NoRope:
    """The module's ``apply_rotary_pos_emb`` replaced by the identity, noting whether the module called it."""

    def __init__(self):
        self.called, self.width = False, 0

    def __call__(self, q, k, *args, **kwargs):
        self.called, self.width = True, q.shape[-1]
        return q, k


@contextmanager
def _without_rope(attn):
    namespace = sys.modules.get(type(attn).__module__)
    own = getattr(namespace, "apply_rotary_pos_emb", None)
    recorder = _NoRope()
    if own is not None:
        namespace.apply_rotary_pos_emb = recorder
    try:
        yield recorder
    finally:
        if own is not None:
            namespace.apply_rotary_pos_emb = own


def module_call(attn, hidden: torch.Tensor, position_embeddings=None) -> ModuleCall:
    """What ``attn`` computes for the rows ``hidden`` ``[b, n, hidden]`` up to its attention function: its own
    projections, norms and (given ``position_embeddings``, the rows' ``(cos, sin)``) RoPE; None: before RoPE (its
    rotation replaced by the identity). Nothing is stored in any cache."""
    rope = _without_rope(attn) if position_embeddings is None else nullcontext()
    with torch.no_grad(), routed_to(attn, CAPTURE_ATTENTION, _capture), rope:
        try:
            attn.forward(hidden, position_embeddings=position_embeddings or (None, None), attention_mask=None)
        except _Captured as captured:
            return captured.call
    raise InputError(f"model_type={attn.config.model_type!r} is not supported: its attention does not go through "
                     "transformers' attention functions, so the compressor cannot read it as the model attends")


_READINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reading(attn) -> ModuleReading:
    """``attn`` probed on one row of zeros (once per module): its attention form, whether it rotates, its shapes.
    Refused in one line where the compressor could not read it as the model attends."""
    if attn in _READINGS:
        return _READINGS[attn]
    config = getattr(attn, "config", None)
    model_type = getattr(config, "model_type", "?")
    if config is None or not hasattr(config, "_attn_implementation"):
        raise InputError(f"model_type={model_type!r} is not supported: its attention module ({type(attn).__name__}) "
                         "has no model config, so it does not go through transformers' attention functions")
    parameters = set(inspect.signature(attn.forward).parameters)
    if not set(CACHE_ARGUMENTS) & parameters:
        raise InputError(f"model_type={model_type!r} is not supported: its attention takes its cache under none of "
                         f"the names {', '.join(CACHE_ARGUMENTS)}, so the compressor cannot find the layer's keys")
    if "position_embeddings" not in parameters:
        raise InputError(f"model_type={model_type!r} is not supported: its attention takes no rotary "
                         "position_embeddings (learned, ALiBi or no positions), which the compressor's queries and "
                         "positions after a cut assume")
    if getattr(attn.config, "kv_lora_rank", None):
        raise InputError(f"model_type={model_type!r} is not supported: multi-head latent attention (MLA, kv_lora_rank="
                         f"{attn.config.kv_lora_rank}): its keys and values differ in width and its cache holds "
                         "them decompressed per head, which the compressor does not read")
    weight = next(attn.parameters())
    hidden = torch.zeros(1, 1, attn.config.hidden_size, dtype=weight.dtype, device=weight.device)
    with torch.no_grad(), routed_to(attn, CAPTURE_ATTENTION, _capture), _without_rope(attn) as rope:
        try:
            attn.forward(hidden, position_embeddings=(None, None), attention_mask=None)
            call = None
        except _Captured as captured:
            call = captured.call
        except Exception as error:  # noqa: BLE001 - any failure: a module that reads RoPE otherwise
            raise InputError(f"model_type={model_type!r} is not supported: its attention applies RoPE otherwise than "
                             f"through apply_rotary_pos_emb(q, k, cos, sin) ({type(error).__name__}), so the "
                             "compressor cannot read its queries as the model attends") from None
    if call is None:
        raise InputError(f"model_type={model_type!r} is not supported: its attention does not go through "
                         "transformers' attention functions, so the compressor cannot read it as the model attends")
    query, key, value = call.query, call.key, call.value
    if query.dim() != 4 or key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1] \
            or query.shape[1] % key.shape[1]:
        raise InputError(f"model_type={model_type!r} is not supported: its keys ({key.shape[-1]} channels) and values "
                         f"({value.shape[-1]}) differ in width (multi-head latent attention or another layout), which "
                         "the compressor's caches do not hold")
    probed = ModuleReading(call.form, rope.called, rope.width, query.shape[1], key.shape[1], key.shape[-1],
                           value.shape[-1])
    _READINGS[attn] = probed
    return probed


def check_supported(model) -> None:
    """Fail loudly, in one line, for a model whose attention the compressor cannot read exactly (never a silently
    wrong selection): every decoder layer's attention module is probed (``reading``)."""
    for layer in decoder_layers(model):
        attn = attention_of(layer)
        if attn is None or not hasattr(attn, "layer_idx"):
            raise InputError(f"model_type={model.config.model_type!r} is not supported: its decoder layers have no "
                             "attention module with a layer_idx (self_attn)")
        reading(attn)


def rope_function(attn):
    """The module's own ``apply_rotary_pos_emb`` (None where its file has none)."""
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def rotated(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, heads, n, d]`` rotated as ``attn`` rotates its queries at ``cos``/``sin`` (its rows' position
    embeddings): the module's own ``apply_rotary_pos_emb`` (partial, interleaved, ...); unchanged on a layer that
    applies no RoPE."""
    probe = reading(attn)
    if not probe.rotates:
        return x
    if probe.rope_width != probe.head_dim:
        raise InputError(f"model_type={attn.config.model_type!r}: its attention rotates a slice of each head it cuts "
                         "itself (partial rotary outside apply_rotary_pos_emb), which a method applying RoPE on its "
                         "own cannot follow; choose a method that reads the module's queries (snapkv, adakv, ...)")
    out, _ = rope_function(attn)(x, x[:, :1], cos, sin)
    return out


def window_queries(attn, hidden_states: torch.Tensor, position_embeddings, n: int) -> torch.Tensor:
    """Query states ``[b, H, n, d]`` of the last ``n`` positions, as the module computes them."""
    return queries_at(attn, hidden_states, position_embeddings, slice(-n, None))


def queries_at(attn, hidden_states: torch.Tensor, position_embeddings, rows: slice) -> torch.Tensor:
    """Query states ``[b, H, n, d]`` of the positions ``rows``, as the module computes them (projected from those
    rows alone, as kvpress's ``get_prerope_query_states`` projects a window)."""
    if position_embeddings is None:  # a layer given no rotary embedding (Beam's) rotates nothing
        return module_call(attn, hidden_states[:, rows]).query
    cos, sin = position_embeddings
    return module_call(attn, hidden_states[:, rows], (cos[:, rows], sin[:, rows])).query


def prerope_queries(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """Query states ``[b, H, n, d]`` of ``hidden_states`` before RoPE (after the module's query norm), as the
    module computes them."""
    return module_call(attn, hidden_states).query


def prerope_keys(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """Key states ``[b, Hkv, n, d]`` of ``hidden_states`` before RoPE (after the module's key norm)."""
    return module_call(attn, hidden_states).key


def rotation_matrices(attn, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[n, d, d]``: per position of ``cos``/``sin`` ``[n, r]``, the matrix ``R`` with ``rotated(x) = R x`` as the
    module rotates (its own function applied to the identity; the identity on a layer without RoPE)."""
    d = reading(attn).head_dim
    n = cos.shape[0]
    identity = torch.eye(d, device=cos.device, dtype=cos.dtype)
    if not reading(attn).rotates:
        return identity.expand(n, d, d)
    basis = identity.expand(n, d, d).unsqueeze(2)            # [n, d basis vectors, 1, d]
    out = rotated(attn, basis, cos[:, None], sin[:, None])   # [n, d, 1, d]: row i is R e_i
    return out[:, :, 0].transpose(1, 2)


def rotates_as_llama(attn, rotary) -> bool:
    """Whether the layer rotates as Llama does, ``x cos + rotate_half(x) sin`` over every channel with the angles of
    ``rotary.inv_freq`` (what a method with a RoPE formula of its own assumes: re-rotated keys)."""
    probe = reading(attn)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not probe.rotates or inv_freq is None or 2 * inv_freq.numel() != probe.head_dim:
        return False
    d = probe.head_dim
    angles = inv_freq.detach().double().cpu()[None] * 3.0
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = torch.randn(1, 1, 1, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    try:
        own, _ = rope_function(attn)(x, x, cos[None], sin[None])
    except RuntimeError:  # its function takes other shapes (gpt-oss: half-width cos and sin)
        return False
    llama = x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * sin
    return bool(torch.allclose(own, llama))


KEEP_ATTENTION = "snapkv_keep"
_KEEPING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keep(module, query, key, value, attention_mask=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    inner, callback = _KEEPING[module]
    callback(query)
    own_eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(inner, own_eager)(module, query, key, value, attention_mask,
                                                                    **kwargs)


def keep_queries(attn, callback) -> None:
    """Until ``stop_keeping``: ``attn``'s next calls hand their queries (post-RoPE, as its attention takes them) to
    ``callback`` before attending as they would."""
    from transformers import AttentionInterface
    if KEEP_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(KEEP_ATTENTION, _keep)
    if attn not in _KEEPING:
        _KEEPING[attn] = (attn.config._attn_implementation, callback)
        attn.config._attn_implementation = KEEP_ATTENTION


def stop_keeping(attn) -> None:
    inner, _ = _KEEPING.pop(attn, (None, None))
    if inner is not None:
        attn.config._attn_implementation = inner


def layer_rotary(rotary, attn, like: torch.Tensor, position_ids: torch.Tensor):
    """``(cos, sin)`` of ``position_ids`` as the model's rotary embedding gives ``attn``'s layer (Gemma 3's takes the
    layer's type: its sliding layers have a RoPE base of their own)."""
    if "layer_type" in inspect.signature(type(rotary).forward).parameters:  # the class's (a session may wrap it)
        return rotary(like, position_ids, attn.config.layer_types[attn.layer_idx])
    return rotary(like, position_ids)


def output_projection(attn) -> torch.nn.Module:
    """The attention module's output projection (``o_proj``; GPT-NeoX's ``dense``), for a method weighing values by
    it (CriticalKV, KVzip+); one line where it has none the compressor knows."""
    for name in ("o_proj", "dense"):
        projection = getattr(attn, name, None)
        if isinstance(projection, torch.nn.Linear):
            return projection
    raise InputError(f"model_type={attn.config.model_type!r}: its attention has no output projection the compressor "
                     "knows (o_proj, dense), which this method weighs values by")
