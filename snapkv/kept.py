"""Which prompt positions a cache kept, per layer, batch row and head (``snapkv.kept_positions``)."""
from __future__ import annotations

import torch

from .cache_state import state_of
from .errors import InputError


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
        rows, heads = layer.keys.shape[:2]
        slots = state.prompt_slots.get(idx) if state is not None else None
        if slots is None:
            length = state.prompt_length if state is not None else layer.keys.shape[-2]
            positions, valid = torch.arange(length, dtype=torch.int32).expand(rows, heads, length), None
        else:
            positions, valid = slots.cpu(), state.head_masks.get(idx)
            valid = None if valid is None else valid.cpu()
        pads = state.row_pads if state is not None and state.row_pads is not None else torch.zeros(rows)
        per_row = []
        for row in range(rows):
            pad = int(pads[row])
            per_head = []
            for head in range(heads):
                here = positions[row, head]
                real = here >= pad
                if valid is not None:
                    real &= valid[row, head]
                per_head.append((here[real] - pad).to(torch.long).sort().values)
            per_row.append(per_head)
        layers.append(per_row)
    return layers
