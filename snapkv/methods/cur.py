"""CurDKV (Sengupta et al., arXiv 2509.15038, "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition"): a position matters as much as its key's and value's approximate leverage scores.

As kvpress 0.5.5 ``CURPress`` scores it, with its defaults (4 sinks, the product of the key and value
scores, no random projection, local approximation over windows of 16): each position's squared key norm
and squared value norm, each divided by its sum over the position's window of ``local_window_size``
(windows from the prompt's first position; the last one zero-padded), multiplied (``leverage_type``), then
divided by their sum over the prompt; the first ``num_sinks`` positions score 1. With
``use_random_leverage`` the keys and values are first projected on a Gaussian ``[head_dim, 20]`` matrix,
which kvpress draws from torch's global generator (unseeded); here it is drawn from a generator seeded
by ``seed`` and the layer's index, on the keys' device and in their dtype (what ``torch.manual_seed`` of
that number just before kvpress's draw gives).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import check_bool, check_choice, check_int
from ..memory import votes_bytes
from ..prompt_scores import WholePromptMethod, by_real_rows
from ..registry import register

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
PROJECTION_RANK = 20  # kvpress's r for use_random_leverage


def windowed(norms: torch.Tensor, window: int) -> torch.Tensor:
    """``[b, h, n]`` each divided by its sum over its window of ``window`` positions (the last window
    zero-padded)."""
    b, h, n = norms.shape
    padded = F.pad(norms, (0, (window - n % window) % window)).reshape(b, h, -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[:, :, :n]


def cur_scores(keys: torch.Tensor, values: torch.Tensor, num_sinks: int, leverage_type: str,
               projection: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """``[b, kv_heads, n]`` scores of every prompt position, as ``CURPress.score`` computes them
    (``projection``: the random matrix, or None; ``window``: the local approximation's, or None)."""
    if projection is not None:
        keys, values = keys @ projection, values @ projection
    k2 = (keys ** 2).sum(dim=-1)
    v2 = (values ** 2).sum(dim=-1)
    if window is not None:
        k2, v2 = windowed(k2, window), windowed(v2, window)
    scores = {"key": lambda: k2, "value": lambda: v2, "kv_avg": lambda: (k2 + v2) / 2,
              "kv_product": lambda: k2 * v2}[leverage_type]()
    scores = scores / scores.sum(dim=-1, keepdim=True)
    scores[:, :, :num_sinks] = 1.0
    return scores


@register
@dataclass
class CUR(WholePromptMethod):
    method = "cur"
    display_name = "CurDKV"
    kvpress_entries = {"cur": {}}
    paper = "CurDKV, arXiv 2509.15038"
    reference = ("kvpress 0.5.5 `CURPress` with its defaults (4 sinks, key x value leverage, local windows of 16, "
                 "no random projection)")
    budget_meaning = "tokens per KV head, the sinks included"
    deviations = "`use_random_leverage`: the projection is drawn from a seeded generator (kvpress: torch's global one)"
    scores_positions = True
    tag_parts = ("s{num_sinks}", "{leverage_type}", "rl{use_random_leverage}", "la{use_local_approximation}",
                 "lw{local_window_size}", "seed{seed}")
    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: int = 0  # the random projection's (use_random_leverage only)

    def validate(self) -> None:
        super().validate()
        check_int("num_sinks", self.num_sinks, 0)
        check_choice("leverage_type", self.leverage_type, LEVERAGE_TYPES)
        check_bool("use_random_leverage", self.use_random_leverage)
        check_bool("use_local_approximation", self.use_local_approximation)
        check_int("local_window_size", self.local_window_size, 1)
        check_int("seed", self.seed, 0)

    def projection(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor | None:
        """The Gaussian ``[head_dim, 20] / sqrt(20)`` of ``use_random_leverage`` for this layer (else None)."""
        if not self.use_random_leverage:
            return None
        generator = torch.Generator(device=keys.device).manual_seed(self.seed * 100_003 + layer_idx)
        drawn = torch.randn(keys.shape[-1], PROJECTION_RANK, generator=generator, device=keys.device, dtype=keys.dtype)
        return drawn / math.sqrt(PROJECTION_RANK)

    def score(self, ctx):
        projection = self.projection(ctx.keys, ctx.layer_idx)
        window = self.local_window_size if self.use_local_approximation else None
        return by_real_rows(ctx.pad_mask, lambda rows, first: cur_scores(
            ctx.keys[rows, :, first:], ctx.values[rows, :, first:], self.num_sinks, self.leverage_type,
            projection, window))

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # keys and values alone

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The squared keys (and values), or their projections; then a few scores per position."""
        squares = batch * shape.kv_heads * length * shape.head_dim * nbytes
        return squares + 6 * votes_bytes(shape, length, batch)
