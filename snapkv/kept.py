"""Which prompt positions a cache kept, per layer, batch row and head (``snapkv.kept_positions``), and what its cut
ranked (``snapkv.ranking_scores``)."""
from __future__ import annotations

import torch

from .cache_state import RankedScores, state_of
from .errors import InputError
from .ragged import RaggedLayer


def kept_positions(cache) -> list[list[list[torch.Tensor]]]:
    """``[layer][batch row][head]``: a LongTensor of the prompt positions that head kept, ascending.

    Positions count from each row's first real token (a left-padded row's padding is never listed).
    A head is a KV head, or a query head for a ``gqa="repeat"`` cache. Uniform methods give every head
    of a layer the same count; head-adaptive ones (``adakv``, ``critical_adakv``, ``kvzip``) do not. A layer that
    nothing was cut from lists every prompt position. Tokens appended after the prompt (decoded tokens,
    an uncompressed later turn) are not listed; a later turn that was compressed
    (``compress_later_turns``) is, with the positions it kept."""
    state = state_of(cache)
    if state is not None and state.cfg is None:  # only snapkv.merge_caches makes a state of no setting
        raise InputError("kept_positions: a merged cache (snapkv.merge_caches) mixes several prompts' caches; "
                         "read each cache's kept positions before merging")
    layers = []
    for idx, layer in enumerate(cache.layers):
        rows, heads = layer.keys.shape[0], getattr(layer, "kv_heads", layer.keys.shape[1])
        pads = state.row_pads if state is not None and state.row_pads is not None else torch.zeros(rows)
        if isinstance(layer, RaggedLayer):
            listed = layer.kept_positions()
        else:
            slots = state.prompt_slots.get(idx) if state is not None else None
            if slots is None:
                length = state.prompt_length if state is not None else layer.keys.shape[-2]
                slots = torch.arange(length, dtype=torch.int32).expand(rows, heads, length)
            slots = slots.cpu()
            listed = [[slots[row, head] for head in range(heads)] for row in range(rows)]
        per_row = []
        for row, per_head in enumerate(listed):
            pad = int(pads[row])
            per_row.append([(here[here >= pad] - pad).to(torch.long).sort().values for here in per_head])
        layers.append(per_row)
    return layers


def ranking_scores(cache) -> list[RankedScores | None]:
    """``[layer]``: what that layer's prefill cut ranked, ``RankedScores(scores, low, high)``, each ``[batch row,
    head, prompt position]`` (padded positions included) as this machine computed them, ``low``/``high`` how far
    another machine's rounding could move each score (``Method.ranking_bounds``, by ``method.TIE_TOLERANCE`` unless
    ``record_scores`` gave another); None for a layer kept whole or a method whose cut is no per-head ranking
    (``Method.ranking_scores``). Recorded only by ``snapkv.compress(..., record_scores=True)``.

    Where two positions' scores are equal to the last bits, another machine can keep the other one; these tell
    such a tie from a real difference (the parity tests' tolerance: docs/extending.md)."""
    return [recorded(cache, "ranking_scores").get(idx) for idx in range(len(cache.layers))]


def decoding_rankings(cache) -> list[list[RankedScores]]:
    """``[layer]``: what each of that layer's cuts while decoding ranked (``Method.decodes``; uniform cuts by
    ``prompt_scores``), in order: ``RankedScores`` over the layer's slots at that cut, with the position each slot held
    (``positions``) and the slots it kept (``kept``). Recorded only by ``snapkv.compress(..., record_scores=True)``."""
    return [recorded(cache, "decoding_rankings").get(idx, []) for idx in range(len(cache.layers))]


def recorded(cache, what: str) -> dict:
    """The cache's ``CacheState`` record ``what`` (layer -> ...), or one line when no session filled the cache."""
    state = state_of(cache)
    if state is None:
        raise InputError(f"{what}: this cache was not filled inside snapkv.compress")
    return getattr(state, what)
