"""The prefill of a compressing session: the model's own layers, each over the whole prompt in chunks of it.

transformers runs a prefill layer by layer, each layer over the whole sequence at once: the layer's norm,
queries, RoPE temporaries, the concatenated copy of its keys and values, the attention output, the o_proj
output and the MLP's activations all exist for every position, beside the residual stream and the embedding
output it started from. While a session compresses, this module runs each decoder layer over chunks of the
prompt instead (``prefill_chunk`` tokens; the last chunk at least as long as the rows the settings read):

- each chunk calls the layer's own ``forward`` (norm, q/k/v, RoPE, attention, o_proj, MLP: whatever the family
  computes), with its rows of the position ids and position embeddings and the mask transformers builds for
  those queries over the layer's keys so far (``create_causal_mask``, as transformers' own chunked prefill);
- its keys and values are written into one buffer pair of the prompt's length (``PrefillLayer``, no
  concatenation copy), which is the layer's full cache when its last chunk's attention has run: the session
  compresses it there (``snapkv.hooks``), with that chunk's rows of the layer input (``LayerContext``);
- each chunk's output is written back over its rows of the residual stream (they are no longer read: later
  chunks read the keys and values of earlier rows from the buffer), which is the embedding output itself;
- the rotary embedding is computed per chunk (``DeferredRotary``), the model-level mask is not built at all
  (a zero-stride stand-in, ``_no_mask``), and the final norm runs chunk by chunk in place;
- with sdpa on a CPU and no padding, a chunk's attention runs without a mask (``split_attention``): its queries
  over the earlier keys (every one visible) and over its own keys (causal), merged by their log-sum-exp, so no
  ``chunk x L`` mask is built and no masked triangle computed; elsewhere the model's own attention takes the mask.

So a prefill holds the residual stream, one layer's full K and V, the compressed caches and buffers of the
chunk's size; ``snapkv.memory.plan`` counts exactly that. Rows are computed as the one-pass prefill computes them
(the same kernels on fewer rows), except attention, which a query chunk runs over the keys so far with a mask;
``tests/test_prefill.py`` pins the kept positions and tokens against the one-pass prefill.

A setting that reads the layer input of every position (H2O's every query, ObservedAttention's weights,
Compactor's keys before RoPE: ``Method.prefill_rows`` None) runs each layer in one chunk: its own scoring is
quadratic or whole-prompt anyway. ``prefill_chunk=None`` leaves the model's forward as transformers runs it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from .architectures import attention_of, reading, routed_to
from .errors import InputError
from .memory import PREFILL_CHUNK, last_chunk  # noqa: F401 (PREFILL_CHUNK: the session's default, planned there)
from .transformers_workarounds import cache_argument, filled_layer


def check_chunk(chunk) -> int | None:
    """``prefill_chunk``: a positive number of tokens, or None (the model's own one-pass prefill)."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"prefill_chunk={chunk!r} must be a positive number of tokens, or None for the model's "
                         "own one-pass prefill")
    return chunk


def chunk_bounds(length: int, chunk: int, tail: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``[0, length)``: chunks of ``chunk`` tokens, the last one ``tail`` tokens
    if longer (the rows the settings read: None, every row)."""
    head = length - last_chunk(length, chunk, tail)
    return [(start, min(start + chunk, head)) for start in range(0, head, chunk)] + [(head, length)]


class PrefillLayer(DynamicLayer):
    """One layer's keys and values during a chunked prefill: a buffer pair of the prompt's length, filled chunk by
    chunk; ``update`` returns the keys and values written so far (views, no copy)."""

    snapkv_layer = True  # a layer the compression hooks accept in a cache

    def __init__(self, length: int):
        super().__init__()
        self.length, self.written = length, 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            b, heads, _, d = key_states.shape
            # zeros: every page is written at once, so a CPU's resident memory counts the buffer as a GPU's
            # allocator does, from the start (the planner's term); a memset beside a layer's compute
            self.keys = key_states.new_zeros(b, heads, self.length, d)
            self.values = value_states.new_zeros(b, value_states.shape[1], self.length, value_states.shape[-1])
        end = self.written + key_states.shape[-2]
        if end > self.length:
            raise RuntimeError(f"a chunked prefill of {self.length} tokens was given {end}")
        self.keys[:, :, self.written:end] = key_states
        self.values[:, :, self.written:end] = value_states
        self.written = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.written


class _ChunkSizes:
    """What ``create_causal_mask`` reads of a cache, for queries starting at ``start`` over the keys so far."""

    is_compileable = False

    def __init__(self, start: int):
        self.start = start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.start + query_length, 0


class DeferredRotary:
    """The rotary embedding of a chunked prefill: ``(cos, sin)`` of a chunk's rows, computed when the chunk runs."""

    def __init__(self, forward, x: torch.Tensor, position_ids: torch.Tensor):
        self.forward, self.x, self.position_ids = forward, x, position_ids

    def rows(self, start: int, end: int):
        return self.forward(self.x[:, start:end], self.position_ids[:, start:end])

    def __iter__(self):
        raise TypeError("position embeddings of a chunked prefill are computed per chunk (snapkv.prefill): a module "
                        "outside the decoder layers read them; pass prefill_chunk=None to snapkv.compress")


@dataclass
class ChunkedPass:
    """The prefill running now: its length, chunk bounds and what the model was given."""

    length: int
    bounds: list
    padding: torch.Tensor | None       # the 2-D padding mask the model was given
    given_embeds: torch.Tensor | None  # inputs_embeds the caller passed (copied before the residual is written)
    last: bool = False                 # whether the chunk running now is the prompt's last


class ChunkedPrefill:
    """Runs a session's prefills layer by layer in chunks (module docstring): ``attach`` replaces the forwards of
    the decoder layers, the rotary embedding and the final norm; they act only between ``begin`` and ``end``."""

    def __init__(self, model, decoder, layers: list, chunk: int):
        self.model, self.decoder, self.layers, self.chunk = model, decoder, layers, chunk
        self.running: ChunkedPass | None = None
        self._replaced: list = []

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> None:
        for idx, layer in enumerate(self.layers):
            self._replace(layer, self._layer_forward(layer.forward, idx))
        rotary = getattr(self.decoder, "rotary_emb", None)
        if rotary is not None:
            self._replace(rotary, self._rotary_forward(rotary.forward))
        norm = getattr(self.decoder, "norm", None)
        if norm is not None:
            self._replace(norm, self._norm_forward(norm.forward))

    def _replace(self, module, forward) -> None:
        module.forward = forward
        self._replaced.append(module)

    def detach(self) -> None:
        for module in self._replaced:
            del module.forward  # the class's forward is back
        self._replaced.clear()
        self.running = None

    @staticmethod
    def takes(kwargs: dict, config) -> bool:
        """Whether this pass can run chunked: every layer's output is written over the residual stream, so
        nothing may keep a layer's hidden states or attention weights (``output_hidden_states``,
        ``output_attentions``)."""
        return not any(kwargs.get(name, getattr(config, name, False))
                       for name in ("output_hidden_states", "output_attentions"))

    def begin(self, kwargs: dict, tokens: torch.Tensor, tail: int | None) -> None:
        """A prefill of ``tokens`` (ids or embeddings) starts: the model-level mask is replaced by a stand-in
        (each chunk gets its own), and its chunks are planned (the last one at least ``tail`` rows)."""
        b, length = tokens.shape[:2]
        padding = kwargs.get("attention_mask")
        embeds = kwargs.get("inputs_embeds")
        self.running = ChunkedPass(length, chunk_bounds(length, self.chunk, tail), padding, embeds)
        kwargs["attention_mask"] = _no_mask(b, length, tokens.device)

    def end(self) -> None:
        self.running = None

    # -- the replaced forwards ---------------------------------------------------------------
    def _layer_forward(self, forward, idx: int):
        def run(*args, **kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            current = self.running
            if current is None or hidden is None or hidden.dim() != 3 or hidden.shape[1] != current.length:
                return forward(*args, **kwargs)
            if not args:
                kwargs = dict(kwargs)
                kwargs.pop("hidden_states")
            return self._run_layer(forward, idx, hidden, args[1:], kwargs, current)
        return run

    def _run_layer(self, forward, idx: int, hidden, args, kwargs, current: ChunkedPass):
        if hidden is current.given_embeds:  # the caller's tensor is not written over
            hidden = hidden.clone()
        cache = cache_argument(kwargs)
        if cache is not None:  # held by the cache alone: freed as soon as the layer's compression replaces it
            while len(cache.layers) <= idx:  # a cache made without the model's config grows its layers
                cache.layers.append(DynamicLayer())
            cache.layers[idx] = PrefillLayer(current.length)
        attn = attention_of(self.layers[idx])
        split = self._attention(attn)
        rest = None  # what the layer returns beside its hidden states, if anything (the last chunk's)
        for start, end in current.bounds:
            current.last = end == current.length
            rows = hidden[:, start:end]
            chunk_kwargs = {name: _rows(value, start, end, current.length) for name, value in kwargs.items()}
            chunk_kwargs["attention_mask"] = None if split else self._mask(idx, rows, start, end,
                                                                           chunk_kwargs.get("position_ids"))
            with routed(attn, split):
                out = forward(rows, *[_rows(a, start, end, current.length) for a in args], **chunk_kwargs)
            if isinstance(out, tuple):
                out, rest = out[0], out[1:]
            hidden[:, start:end] = out
            del out, chunk_kwargs  # a chunk's output and position embeddings are not held into the next one
        current.last = False
        layer = cache.layers[idx] if cache is not None else None
        if isinstance(layer, PrefillLayer):  # not compressed (full KV, a short prompt): kept as it is
            cache.layers[idx] = filled_layer(layer.keys, layer.values)
        return hidden if rest is None else (hidden, *rest)

    def _attention(self, module):
        """The attention a chunk runs: ``split_attention`` where it applies (module docstring), else the model's."""
        config, current = self.model.config, self.running
        if len(current.bounds) > 1 and current.padding is None and config._attn_implementation == "sdpa" \
                and splits_on(module):
            return PREFILL_ATTENTION
        return None  # one chunk: the model's own attention, as one pass runs it

    def _mask(self, idx: int, rows, start: int, end: int, position_ids):
        """The mask transformers builds for these query rows over the layer's first ``end`` keys (a sliding
        window's on a sliding layer)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        padding = self.running.padding
        sliding = reading(attention_of(self.layers[idx])).form.sliding_window is not None
        build = create_sliding_window_causal_mask if sliding else create_causal_mask
        return build(self.model.config, rows, None if padding is None else padding[:, :end], _ChunkSizes(start),
                     position_ids=position_ids, layer_idx=idx)

    def _rotary_forward(self, forward):
        def run(x, position_ids, *args, **kwargs):
            current = self.running
            if current is None or args or kwargs or x.shape[1] != current.length:
                return forward(x, position_ids, *args, **kwargs)
            return DeferredRotary(forward, x, position_ids)
        return run

    def _norm_forward(self, forward):
        def run(hidden, *args, **kwargs):
            current = self.running
            if current is None or args or kwargs or hidden.dim() != 3 or hidden.shape[1] != current.length:
                return forward(hidden, *args, **kwargs)
            for start, end in current.bounds:  # the residual stream is read no more: normalised in place
                hidden[:, start:end] = forward(hidden[:, start:end])
            return hidden
        return run


PREFILL_ATTENTION = "snapkv_prefill"
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def splits_on(module) -> bool:
    """Whether ``split_attention`` can run this module's chunks: a CPU model, torch's CPU flash kernel (it
    returns the log-sum-exp), plain causal attention (no sliding window, soft-capping or sinks)."""
    weight = next(module.parameters(), None)
    return _CPU_FLASH is not None and weight is not None and weight.device.type == "cpu" and reading(module).form.plain


@contextmanager
def routed(module, name: str | None):
    """The module's attention through ``name`` (``split_attention``) while the context lasts (None: as it is)."""
    if name is None:
        yield
        return
    with routed_to(module, name, split_attention):
        yield


def split_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                    **kwargs):
    """sdpa of a chunk's ``q`` queries, the last ``q`` of the ``L`` positions whose keys are given, without a mask:
    the first chunk is the causal sdpa transformers runs (``enable_gqa``); a later one is its queries over the
    ``L - q`` earlier keys, every one visible (each KV head's query heads stacked as rows: no repeated keys), and
    over its own ``q`` keys, causal, merged by their log-sum-exp. ``[b, q, H, d]``, as transformers' sdpa."""
    b, heads, q_len, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    earlier = length - q_len
    if earlier == 0:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=q_len > 1,
                                                                enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    stacked = query.reshape(b, kv_heads, groups * q_len, d)
    past, past_lse = _CPU_FLASH(stacked, key[:, :, :earlier], value[:, :, :earlier], 0.0, False, scale=scaling)
    past, past_lse = past.reshape(b, heads, q_len, d), past_lse.reshape(b, heads, q_len)
    own_keys, own_values = key[:, :, earlier:], value[:, :, earlier:]
    if groups > 1:
        own_keys = own_keys.repeat_interleave(groups, dim=1)
        own_values = own_values.repeat_interleave(groups, dim=1)
    own, own_lse = _CPU_FLASH(query, own_keys, own_values, 0.0, True, scale=scaling)
    total = torch.logaddexp(past_lse, own_lse)
    merged = past.float() * (past_lse - total).exp()[..., None] + own.float() * (own_lse - total).exp()[..., None]
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


def _no_mask(batch: int, length: int, device) -> torch.Tensor:
    """A 4-D stand-in for the model-level mask (``create_causal_mask`` returns a 4-D mask as it is): zero-stride,
    never read, so no ``L x L`` mask is built; each chunk gets its own."""
    return torch.ones((), dtype=torch.bool, device=device).expand(batch, 1, length, length)


def _rows(value, start: int, end: int, length: int):
    """A layer argument's rows ``[start, end)``: position ids and embeddings (deferred or not), any tensor with a
    sequence dimension of the prompt's length; anything else as it is."""
    if isinstance(value, DeferredRotary):
        return value.rows(start, end)
    if isinstance(value, tuple):
        return tuple(_rows(v, start, end, length) for v in value)
    if torch.is_tensor(value):
        if value.dim() >= 2 and value.shape[1] == length:
            return value[:, start:end]
        if value.dim() == 1 and value.shape[0] == length:
            return value[start:end]
    return value
