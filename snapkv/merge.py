"""Several caches as one batch, so they decode together: the settings of one prefill, or the caches
of several prompts (items in flight).

Decoding reads every weight once per step whatever the batch size, so the settings of a shared
prefill (``snapkv.compress(model, [a, b, ...])``) can decode as one batch: ``merge_caches`` stacks
their caches row after row, each layer left-padded to its longest member, and records per layer which
slots are real. Inside the ``compress`` context every attention then masks the padding, layer by
layer (PyramidKV's layers differ in length). With sdpa attention and members without padding of
their own (batch-1 prompts, a shared prefill's usual case), each member's new token instead attends
over that member's own slots only (``ragged_attention``): a masked batch would read full KV's length
for every row at every step. The batched arithmetic (the projections and MLP of several rows) may
round differently from one cache decoding alone, so a token can differ where two candidates are
nearly tied.

A merged layer keeps room for the tokens still to come (``GrowingLayer``): transformers' own layer
concatenates its whole cache at every step, and a batch padded to its longest member would copy
every row's padding too.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from .architectures import replaced_forwards
from .cache_state import CacheState, set_state, state_of
from .errors import InputError
from .transformers_workarounds import RepeatedKVLayer, report_consumed, takes_ragged_attention


class GrowingLayer(DynamicLayer):
    """A cache layer that writes new tokens into spare room instead of concatenating (the room doubles
    when it runs out); ``keys`` and ``values`` are views of the filled part."""

    snapkv_layer = True  # a layer the compression hooks accept in a cache

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.filled = keys.shape[-2]
        self._keys = self._room(keys, self.filled + spare)
        self._values = self._room(values, self.filled + spare)
        self._show()

    @staticmethod
    def _room(filled: torch.Tensor, capacity: int) -> torch.Tensor:
        room = filled.new_zeros(*filled.shape[:-2], capacity, filled.shape[-1])
        room[..., :filled.shape[-2], :] = filled
        return room

    def _show(self) -> None:
        self.keys = self._keys[..., :self.filled, :]
        self.values = self._values[..., :self.filled, :]

    def update(self, key_states, value_states, *args, **kwargs):
        new = key_states.shape[-2]
        if self.filled + new > self._keys.shape[-2]:
            capacity = 2 * (self.filled + new)
            self._keys, self._values = self._room(self.keys, capacity), self._room(self.values, capacity)
        self._keys[..., self.filled:self.filled + new, :] = key_states
        self._values[..., self.filled:self.filled + new, :] = value_states
        self.filled += new
        self._show()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' ``crop(-n)``): the room they took is written over
        by the next ones."""
        if tokens_to_remove > 0:
            raise InputError(f"crop({tokens_to_remove}): give the tokens to remove as a negative number")
        self.filled += tokens_to_remove
        self._show()


def layout(cache) -> tuple:
    """Per layer, the heads it holds: caches merge only with caches of the same layout (a
    ``gqa="repeat"`` layer holds one KV head per query head). A head-adaptive cache, or one storing fewer key
    channels (``snapkv.channels``), is a layout of its own: it decodes alone."""
    state = state_of(cache)
    if state is not None and state.head_adaptive:
        return ("head-adaptive", id(cache))
    if any(getattr(layer, "attends_itself", False) for layer in cache.layers):
        return ("own layout", id(cache))
    return tuple((type(layer).__name__, layer.keys.shape[1]) for layer in cache.layers)


def reads_own_slots(model, caches: list) -> bool:
    """Whether these caches, merged, decode with each member reading only its own slots (sdpa
    attention, no padding of their own), so that batching them costs no padding reads."""
    states = [state_of(cache) for cache in caches]
    return takes_ragged_attention(model.config) and all(
        state is not None and _own_padding(state) is None for state in states)


def _own_padding(state: CacheState) -> torch.Tensor | None:
    """A cache's own real-slot mask (its kept padding, or its prompt's), None where it has none."""
    return state.kept_mask if state.compressed else state.pad_mask


def _own_mask(state: CacheState, rows: int, length: int, device) -> torch.Tensor:
    """The real slots of one cache's layer before padding: its kept padding, if any."""
    own = _own_padding(state)
    if own is None:
        return torch.ones(rows, length, dtype=torch.bool, device=device)
    if own.shape[1] != length:
        raise InputError("caches: a padded batch whose layers kept different lengths cannot be merged; "
                         "run batch size 1")
    return own


def finish_member(cache, first_row: int) -> None:
    """The member of a merged cache whose rows begin at ``first_row`` has finished decoding: from the
    next step on its rows attend over nothing (their output is zero; their tokens must be ignored), so
    the batch stops reading its slots while the others decode on. The other members' rows compute
    exactly what they computed before. Only where members attend over their own slots
    (``layer_segments``); a masked batch is left as it is."""
    state = state_of(cache)
    if state is not None and state.layer_segments is not None:
        state.layer_segments = [[segment for segment in layer if segment[0] != first_row]
                                for layer in state.layer_segments]


def drop_rows(cache, rows: list[int]) -> None:
    """Remove ``rows`` from a merged cache (their decoding is done): every layer keeps the other rows
    (one copy of them), and the state their positions, masks and member segments. A step then computes
    the remaining rows only."""
    state = state_of(cache)
    if state is None or state.cfg is not None:
        raise InputError("drop_rows: only a merged cache (snapkv.merge_caches) drops rows")
    gone = set(rows)
    total = state.next_positions.shape[0]
    keep = [r for r in range(total) if r not in gone]
    index = torch.tensor(keep)

    def kept(tensor: torch.Tensor) -> torch.Tensor:  # layers may sit on other devices (device_map)
        return tensor[index.to(tensor.device)]
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer._keys, layer._values = kept(layer._keys), kept(layer._values)
            layer._show()
        else:
            layer.keys, layer.values = kept(layer.keys), kept(layer.values)
    state.next_positions = kept(state.next_positions)
    if state.layer_masks is not None:
        state.layer_masks = [kept(mask) for mask in state.layer_masks]
    if state.layer_segments is not None:
        before = [0] * (total + 1)  # rows dropped before each row
        for r in range(total):
            before[r + 1] = before[r] + (r in gone)
        state.layer_segments = [[(a - before[a], b - before[b], start) for a, b, start in layer
                                 if b - before[b] > a - before[a]] for layer in state.layer_segments]


def merge_caches(caches: list, spare_tokens: int = 0) -> DynamicCache:
    """One cache whose rows are ``caches``' rows, in order, for decoding them as one batch, with room
    for ``spare_tokens`` more tokens in every layer (it grows beyond that).

    Every cache must come from a prefill inside one ``snapkv.compress`` context (one prefill's settings,
    or several prompts' caches: each row keeps its own positions), and the result must be decoded
    inside that context. The given caches are emptied layer by layer as
    they are merged, so memory holds one copy (and the room)."""
    states = [state_of(cache) for cache in caches]
    if not caches or any(state is None for state in states):
        raise InputError("caches: merge caches left by a prefill inside snapkv.compress")
    if any(state.head_adaptive for state in states):
        raise InputError("caches: a head-adaptive cache (adakv, critical_adakv, kvzip) holds a different number of "
                         "positions per head and decodes alone; merge uniform caches only")
    if any(getattr(layer, "attends_itself", False) for cache in caches for layer in cache.layers):
        raise InputError("caches: a cache whose layers store fewer key channels (snapkv.channels) decodes alone; "
                         "merge uniform caches only")
    if any(getattr(layer, "is_sliding", False) for cache in caches for layer in cache.layers):
        raise InputError("caches: a cache with the model's sliding-window layers decodes alone (each row's window "
                         "would need a mask of its own); merge caches of models without sliding layers")
    if len({layout(cache) for cache in caches}) > 1:
        raise InputError("caches: the caches hold different heads per layer (gqa='repeat' and not); merge "
                         "caches of one layout (snapkv.merge.layout)")
    merged = DynamicCache()
    masks, segments, padded = [], [], False
    unpadded = all(_own_padding(state) is None for state in states)
    for idx in range(len(caches[0].layers)):
        sources = [cache.layers[idx] for cache in caches]
        longest = max(layer.keys.shape[-2] for layer in sources)
        keys, values, real, layer_segments, first_row = [], [], [], [], 0
        for cache, state, layer in zip(caches, states, sources):
            rows, length = layer.keys.shape[0], layer.keys.shape[-2]
            pad = longest - length
            keys.append(F.pad(layer.keys, (0, 0, pad, 0)))
            values.append(F.pad(layer.values, (0, 0, pad, 0)))
            real.append(F.pad(_own_mask(state, rows, length, layer.keys.device), (pad, 0), value=False))
            layer_segments.append((first_row, first_row + rows, pad))
            first_row += rows
            cache.layers[idx] = DynamicLayer()
        keys, values, mask = torch.cat(keys), torch.cat(values), torch.cat(real)
        segments.append(layer_segments)
        first = sources[0]
        merged.layers.append(RepeatedKVLayer(keys, values, first.groups) if isinstance(first, RepeatedKVLayer)
                             else GrowingLayer(keys, values, spare_tokens))
        masks.append(mask)
        padded = padded or not bool(mask.all())
    state = CacheState(pad_mask=None, next_positions=torch.cat([s.next_positions for s in states]),
                       consumed=max(s.consumed for s in states), in_prefill=False, compressed=True,
                       crop_floor=max(s.consumed for s in states),
                       cache_lengths={i: layer.keys.shape[-2] for i, layer in enumerate(merged.layers)},
                       layer_masks=masks if padded else None,
                       layer_segments=segments if padded and unpadded else None)
    set_state(merged, state)
    report_consumed(merged, state)
    return merged


def _weight_major(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = (linear.weight @ rows.T).T.contiguous()
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextmanager
def weight_major_linears(model):
    """On a CPU, every ``nn.Linear`` of ``model`` computes ``(W @ x.T).T`` instead of ``x @ W.T`` while
    the context lasts: the same product, another BLAS call. For the few rows of a merged batch's
    decoding step the default call is slower than one row's, while weight-major is faster (SmolLM2's
    shapes, 2-core CPU, 5 rows: its vocabulary projection 12.6 -> 5.5 ms, gate/up 0.30 -> 0.13 ms;
    a decoding step of Table 1's five caches 141 -> 125 ms). The sums are accumulated in another
    order, so a token can differ where two candidates are nearly tied: for merged decoding only,
    which may differ anyway. Off a CPU nothing changes."""
    if next(model.parameters()).device.type != "cpu":
        yield
        return
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)]
    with replaced_forwards(linears, lambda linear, _: partial(_weight_major, linear)):
        yield
