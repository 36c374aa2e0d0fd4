"""Several caches of one prefill as one batch, so their settings decode together.

Decoding reads every weight once per step whatever the batch size, so the settings of a shared
prefill (``snapkv.compress(model, [a, b, ...])``) can decode as one batch: ``merge_caches`` stacks
their caches row after row, each layer left-padded to its longest member, and records per layer which
slots are real. Inside the ``compress`` context every attention then masks the padding, layer by
layer (PyramidKV's layers differ in length). The batched arithmetic may round differently from one
cache decoding alone, so a token can differ where two candidates are nearly tied.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from .config import InputError
from .patch import CacheState, RepeatedKVLayer, filled_layer, report_consumed, set_state, state_of


def layout(cache) -> tuple:
    """Per layer, the heads it holds: caches merge only with caches of the same layout (a
    ``gqa="repeat"`` layer holds one KV head per query head)."""
    return tuple((type(layer).__name__, layer.keys.shape[1]) for layer in cache.layers)


def _own_mask(state: CacheState, rows: int, length: int, device) -> torch.Tensor:
    """The real slots of one cache's layer before padding: its kept padding, if any."""
    own = state.kept_mask if state.compressed else state.pad_mask
    if own is None:
        return torch.ones(rows, length, dtype=torch.bool, device=device)
    if own.shape[1] != length:
        raise InputError("caches: a padded batch whose layers kept different lengths cannot be merged; "
                         "run batch size 1")
    return own


def merge_caches(caches: list) -> DynamicCache:
    """One cache whose rows are ``caches``' rows, in order, for decoding them as one batch.

    Every cache must come from the same prefill inside ``snapkv.compress`` (same prompt length), and
    the result must be decoded inside that context. The given caches are emptied layer by layer as
    they are merged, so memory holds one copy."""
    states = [state_of(cache) for cache in caches]
    if not caches or any(state is None for state in states):
        raise InputError("caches: merge caches left by a prefill inside snapkv.compress")
    if len({state.consumed for state in states}) > 1:
        raise InputError("caches: the caches come from prompts of different lengths; merge one prefill's caches")
    if len({layout(cache) for cache in caches}) > 1:
        raise InputError("caches: the caches hold different heads per layer (gqa='repeat' and not); merge "
                         "caches of one layout (snapkv.merge.layout)")
    merged = DynamicCache()
    masks, padded = [], False
    for idx in range(len(caches[0].layers)):
        sources = [cache.layers[idx] for cache in caches]
        longest = max(layer.keys.shape[-2] for layer in sources)
        keys, values, real = [], [], []
        for cache, state, layer in zip(caches, states, sources):
            rows, length = layer.keys.shape[0], layer.keys.shape[-2]
            pad = longest - length
            keys.append(F.pad(layer.keys, (0, 0, pad, 0)))
            values.append(F.pad(layer.values, (0, 0, pad, 0)))
            real.append(F.pad(_own_mask(state, rows, length, layer.keys.device), (pad, 0), value=False))
            cache.layers[idx] = DynamicLayer()
        keys, values, mask = torch.cat(keys), torch.cat(values), torch.cat(real)
        first = sources[0]
        merged.layers.append(RepeatedKVLayer(keys, values, first.groups) if isinstance(first, RepeatedKVLayer)
                             else filled_layer(keys, values))
        masks.append(mask)
        padded = padded or not bool(mask.all())
    state = CacheState(pad_mask=None, next_positions=torch.cat([s.next_positions for s in states]),
                       consumed=states[0].consumed, in_prefill=False, compressed=True,
                       cache_lengths={i: layer.keys.shape[-2] for i, layer in enumerate(merged.layers)},
                       layer_masks=masks if padded else None)
    set_state(merged, state)
    report_consumed(merged, state)
    return merged
