"""The paper's hit rate (§4), on attention tensors.

For one head and a prefix of ``P`` positions: the current queries' attention over the prefix is
``A_cur`` ``[n, P]``; the positions each current query attends to above ``theta`` are "important"
(``A_cur > theta``, counted per (query, position) pair); the observation window votes
``C = sum of its attention rows over the prefix``; ``I = top-k(C)`` with ``k = floor(p * P)``, where
``p`` is the kept fraction (the arXiv v2 text writes ``k = p L``, the camera-ready ``(1 - p) L``: here
``p`` is the fraction kept). The hit rate is ``|important ∩ I| / |important|`` over all pairs; a
head with no important pair has no hit rate (NaN).
"""
from __future__ import annotations

import math

import torch

from snapkv.select import pool


def selected(votes: torch.Tensor, p: float, pooling: str = "none", kernel: int = 1) -> torch.Tensor:
    """Boolean ``[heads, P]``: the top ``floor(p * P)`` positions of each head's (pooled) votes."""
    heads, prefix = votes.shape
    k = math.floor(p * prefix)
    mask = torch.zeros(heads, prefix, dtype=torch.bool, device=votes.device)
    if k > 0:
        scores = pool(votes[None].float(), pooling, kernel)[0]
        mask.scatter_(1, scores.topk(k, dim=-1).indices, True)
    return mask


def hit_rates(current: torch.Tensor, votes: torch.Tensor, p: float, theta: float,
              pooling: str = "none", kernel: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit_rate, important)`` per head: ``current`` ``[heads, n, P]``, ``votes`` ``[heads, P]``."""
    return counted_hit_rates(important_counts(current, theta), votes, p, pooling, kernel)


def important_counts(current: torch.Tensor, theta: float) -> torch.Tensor:
    """Per head and position, how many current queries attend to it above ``theta``: ``[heads, P]``.
    A prefix of these counts is the counts over that prefix, so several prefixes share one pass."""
    return (current > theta).sum(dim=1)


def counted_hit_rates(counts: torch.Tensor, votes: torch.Tensor, p: float, pooling: str = "none",
                      kernel: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``hit_rates`` from ``important_counts`` over the prefix ``[heads, P]`` (the same integers)."""
    chosen = selected(votes, p, pooling, kernel)
    hits = (counts * chosen).sum(dim=-1).float()
    total = counts.sum(dim=-1).float()
    rate = torch.where(total > 0, hits / total.clamp(min=1), torch.full_like(total, float("nan")))
    return rate, total.long()


def overlap(votes_a: torch.Tensor, votes_b: torch.Tensor, p: float, pooling: str = "none",
            kernel: int = 1) -> torch.Tensor:
    """Per head, the share of one selected set also in the other (same prefix, same k)."""
    a, b = selected(votes_a, p, pooling, kernel), selected(votes_b, p, pooling, kernel)
    k = a.sum(dim=-1).float()
    return torch.where(k > 0, (a & b).sum(dim=-1).float() / k.clamp(min=1), torch.full_like(k, float("nan")))
