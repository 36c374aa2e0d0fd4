"""LagKV (Liang et al., arXiv 2504.04704, "LagKV: Lag-Relative Information of the KV Cache Tells Which
Tokens Are Important"): a position matters as much as its key and value stand out from the next
partition of the prompt, which serves as its reference.

As kvpress 0.5.5 ``LagKVPress`` scores it, with its defaults (4 sinks, partitions of 128, no cross
scoring): after the ``n_sink`` first positions the prompt is cut into partitions of ``lag_size``; each
partition but the last whole one is scored against the next: its keys (and values) min-max scaled per
channel by the next partition's range, the standard deviation over the channels, a softmax over the
partition; the key and value scores averaged, then ranked within the partition (``rank / lag_size``). The
sinks and the tail (the last whole partition and the rest) score 1, so they are kept first. A prompt
shorter than ``n_sink + 2 * lag_size`` is scored by recency (the sinks 1, then ``i / (n - n_sink)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import check_bool, check_int
from ..memory import votes_bytes
from ..prompt_scores import WholePromptMethod, by_real_rows
from ..registry import register


def lag_relative(states: torch.Tensor) -> torch.Tensor:
    """``states`` ``[b, h, parts, lag, d]`` -> ``[b, h, parts - 1, lag]``: each partition but the last,
    min-max scaled per channel by the next partition's range, its std over channels, softmaxed over the
    partition (kvpress's ``LagKVPress._get_states_score``)."""
    ref, part = states[:, :, 1:], states[:, :, :-1]
    low = ref.min(dim=-2, keepdim=True).values
    high = ref.max(dim=-2, keepdim=True).values
    return ((part - low) / (high - low)).std(dim=-1).softmax(dim=-1)


def partitioned(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag_size: int) -> torch.Tensor | None:
    """``[b, kv_heads, parts, lag_size]``: each scored partition's lag-relative scores before any ranking, or None
    for a prompt too short to partition."""
    b, h, n, d = keys.shape
    if n < n_sink + 2 * lag_size:
        return None
    end = n_sink + ((n - n_sink) // lag_size) * lag_size

    def parts(states):
        return states[:, :, n_sink:end].reshape(b, h, -1, lag_size, d)
    return (lag_relative(parts(keys)) + lag_relative(parts(values))) / 2


def around(scores: torch.Tensor, fill, n_sink: int, n: int) -> torch.Tensor:
    """The partitions' ``scores`` ``[b, h, parts, lag]`` as ``[b, h, n]``: the sinks and the tail ``fill``."""
    b, h = scores.shape[:2]
    flat = scores.reshape(b, h, -1)
    sinks = torch.full((b, h, n_sink), fill, dtype=flat.dtype, device=flat.device)
    rest = torch.full((b, h, n - n_sink - flat.shape[-1]), fill, dtype=flat.dtype, device=flat.device)
    return torch.cat((sinks, flat, rest), dim=-1)


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag_size: int,
                 cross_scoring: bool) -> torch.Tensor:
    """``[b, kv_heads, n]`` scores of every prompt position, as ``LagKVPress.score`` computes them."""
    b, h, n, d = keys.shape
    scores = partitioned(keys, values, n_sink, lag_size)
    if scores is None:  # too short to partition: the sinks, then the most recent first
        scores = torch.ones((b, h, n), dtype=keys.dtype, device=keys.device)
        if n > n_sink:
            scores[:, :, n_sink:] = (torch.arange(n - n_sink, device=keys.device) / (n - n_sink)).to(keys.dtype)
        return scores
    if not cross_scoring:
        scores = (scores.argsort(dim=-1).argsort(dim=-1) / lag_size).to(keys.dtype)
    return around(scores, 1, n_sink, n)


def rank_bounds(raw: torch.Tensor, tolerance: float) -> tuple:
    """``(below, above)`` ``[b, h, parts, lag]``: how many ranks each position could move down and up within its
    partition were its raw score and the others' rounded otherwise by ``tolerance`` relative: the positions ranked
    below and above it within that distance."""
    rank = raw.argsort(dim=-1).argsort(dim=-1)
    near = (raw[..., :, None] - raw[..., None, :]).abs() <= tolerance * raw.abs()[..., :, None]
    below = (near & (rank[..., None, :] < rank[..., :, None])).sum(dim=-1)
    above = (near & (rank[..., None, :] > rank[..., :, None])).sum(dim=-1)
    return below, above


@register
@dataclass
class LagKV(WholePromptMethod):
    method = "lagkv"
    display_name = "LagKV"
    kvpress_entries = {"lagkv": {}}
    paper = "LagKV, arXiv 2504.04704"
    reference = ("kvpress 0.5.5 `LagKVPress` with its defaults (4 sinks, partitions of 128, each scored against "
                 "the next; no cross scoring)")
    budget_meaning = "tokens per KV head, the sinks and the tail partition included"
    deviations = "none (parity-tested)"
    scores_positions = True
    tag_parts = ("s{n_sink}", "lag{lag_size}", "cross{cross_scoring}")
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def validate(self) -> None:
        super().validate()
        check_int("n_sink", self.n_sink, 0)
        check_int("lag_size", self.lag_size, 1)
        check_bool("cross_scoring", self.cross_scoring)

    def score(self, ctx):
        return by_real_rows(ctx.pad_mask, lambda rows, first: lagkv_scores(
            ctx.keys[rows, :, first:], ctx.values[rows, :, first:], self.n_sink, self.lag_size, self.cross_scoring))

    def ranking_bounds(self, ctx, scores, tolerance: float) -> tuple:
        """Ranks, not scores, are ranked (without cross scoring): two positions of one partition whose raw scores tie
        within ``tolerance`` can swap ranks, so each rank's bounds reach the ranks of its ties."""
        raw = None if self.cross_scoring or ctx.pad_mask is not None else partitioned(
            ctx.keys, ctx.values, self.n_sink, self.lag_size)
        if raw is None:
            return super().ranking_bounds(ctx, scores, tolerance)
        n = ctx.keys.shape[-2]
        below, above = (around(steps.to(scores.dtype) / self.lag_size, 0, self.n_sink, n).to(scores.device)
                        for steps in rank_bounds(raw, tolerance))
        return scores - below, scores + above

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # keys and values alone

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scaled copy of the partitioned keys (then values) and its deviation, the ranks, the scores."""
        scaled = 2 * batch * shape.kv_heads * length * shape.head_dim * nbytes
        return scaled + 8 * 2 * batch * shape.kv_heads * length + 3 * votes_bytes(shape, length, batch)
