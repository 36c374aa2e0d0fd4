"""Head-adaptive budgets (AdaKV, CriticalAdaKV): one layer's kept positions chosen across all its KV
heads at once, so heads keep different numbers of positions at the same total.

Each step follows kvpress 0.5.5 (``AdaKVPress.compress``, ``CriticalAdaKVPress.compress``) on one batch
row: ``scores`` ``[1, heads, n]`` rank every position of the row's prompt, ``n_kept`` is the average per
head. kvpress masks what it evicts and keeps it in memory; here the kept positions are returned and the
cache stores only those, padded to the layer's longest head (``pack``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def safeguarded(scores: torch.Tensor, n_kept: int, alpha: float) -> torch.Tensor:
    """Each head's top ``int(n_kept * alpha)`` (at least 1 when ``alpha > 0``) raised to the dtype's
    maximum, so every head keeps at least that many (in place; returns ``scores``)."""
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    top = torch.topk(scores, n_safe, dim=-1).indices
    return scores.scatter_(-1, top, torch.finfo(scores.dtype).max)


def pruned_across_heads(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """``[rows, heads, n]`` bool, True where kept: the ``heads * (n - n_kept)`` lowest scores of each row,
    over all its heads at once, are evicted (kvpress's bottom-k, ties broken as its ``topk``)."""
    rows, heads, n = scores.shape
    n_pruned = heads * (n - n_kept)
    pruned = torch.topk(-scores.reshape(rows, -1), n_pruned, dim=1).indices
    keep = torch.ones(rows, heads * n, dtype=torch.bool, device=scores.device)
    return keep.scatter_(1, pruned, False).view(rows, heads, n)


def adakv_keep(scores: torch.Tensor, n_kept: int, alpha: float) -> torch.Tensor:
    """AdaKV: the safeguard, then the bottom-k across heads."""
    return pruned_across_heads(safeguarded(scores, n_kept, alpha), n_kept)


def value_output_norms(values: torch.Tensor, attn) -> torch.Tensor:
    """``||v W_O||_1`` of each position per query head, averaged over each KV group ``[b, kv, n]``
    (kvpress's ``CriticalKVPress.vwl1norm``: one query head at a time, never every head's product)."""
    b, n_kv, n, _ = values.shape
    config = attn.config
    heads = config.num_attention_heads
    out_weight = attn.o_proj.weight.transpose(0, 1).view(heads, attn.head_dim, config.hidden_size)
    repeated = values.repeat_interleave(heads // n_kv, dim=1)
    norms = [torch.norm(repeated[:, head].matmul(out_weight[head].unsqueeze(0)), p=1, dim=-1)
             for head in range(heads)]
    return torch.stack(norms, dim=1).view(b, n_kv, heads // n_kv, n).mean(dim=2)


def critical_adakv_keep(scores: torch.Tensor, n_kept: int, alpha: float, values: torch.Tensor, attn,
                        epsilon: float, first_stage_ratio: float) -> torch.Tensor:
    """CriticalAdaKV: the safeguard; each head's budget from one top-k across heads; a first stage that
    keeps each head's top ``first_stage_ratio`` of its budget by score; a second stage by score times
    the projected value norm; then the bottom-k across heads."""
    scores = safeguarded(scores, n_kept, alpha)
    rows, heads, n = scores.shape
    highest = torch.finfo(scores.dtype).max
    top = torch.topk(scores.reshape(rows, -1), n_kept * heads, dim=-1).indices
    head_budgets = torch.zeros(heads, device=scores.device, dtype=torch.int64)
    head_budgets.scatter_add_(0, (top // n).flatten(), torch.ones_like(top.flatten()))
    first = (head_budgets * first_stage_ratio).to(torch.int64).tolist()
    ranked = torch.topk(scores, max(first), sorted=True, dim=-1).indices
    for head in range(heads):
        scores[:, head, :].scatter_(-1, ranked[:, head, :first[head]], highest)
    scores = (scores + epsilon) * value_output_norms(values, attn)
    budgets = head_budgets.tolist()
    ranked = torch.topk(scores, max(budgets), sorted=True, dim=-1).indices
    for head in range(heads):
        scores[:, head, :].scatter_(-1, ranked[:, head, :budgets[head]], highest)
    return pruned_across_heads(scores, n_kept)


def per_row_keep(scores: torch.Tensor, pad_mask: torch.Tensor | None, keep_row) -> torch.Tensor:
    """``keep_row(row_scores, row, first)`` -> ``[1, heads, n - first]`` for each batch row on its real
    tokens (from ``first``, its padding); padded positions are never kept."""
    pads = [0] * scores.shape[0] if pad_mask is None else (~pad_mask).sum(dim=1).tolist()
    rows = [F.pad(keep_row(scores[row:row + 1, :, pad:].clone(), row, pad), (pad, 0), value=False)
            for row, pad in enumerate(pads)]
    return torch.cat(rows)


def pack(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep`` ``[b, heads, n]`` to ``(kept, valid)`` ``[b, heads, longest]``: each head's kept positions
    ascending, then (``valid`` False) positions it did not keep, which are stored but never attended to."""
    counts = keep.sum(dim=-1)
    longest = int(counts.max())
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :longest]
    valid = torch.arange(longest, device=keep.device) < counts[..., None]
    return order, valid
