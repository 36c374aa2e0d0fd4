"""AdaKV (Feng et al., arXiv 2407.11550, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation"): a layer's budget (KV heads x the per-head budget) goes to the positions a scorer ranks
highest across all its KV heads at once, each head keeping at least ``alpha_safeguard`` of its share.

As kvpress 0.5.5 ``AdaKVPress(SnapKVPress())`` runs it by default (``snapkv.head_budgets``): the scorer
is kvpress's SnapKV (the window's attention averaged over its queries, average pooling of ``kernel``,
averaged over each KV group, the window itself always kept); ``scorer=`` takes any method that scores
positions instead. kvpress keeps every key and masks the evicted ones; here each head stores only what
it keeps (``snapkv.ragged``: no padding to the longest head), so ``kv_cache_bytes`` is what is held.

``allocation="authors"`` allocates as the authors' code (FFY0/AdaKV ``adaptive_snapkv``) does: the
window is kept on top of ``budget - window`` earlier positions per head on average; each head's count
``c_h`` comes from one top-k over all heads' earlier positions, and it keeps its own top
``round(c_h (1 - alpha) + int(alpha (budget - window)))``. Their other defaults (window 32, kernel 7,
max pooling, ``alpha_safeguard=0.2`` in their LongBench script) are settings; they reduce a GQA group
before pooling where the scorer here pools first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..errors import check_choice
from ..head_budgets import HeadAdaptiveMethod, adakv_keep, authors_keep, pack, per_row_keep, safeguarded
from ..registry import register

ALLOCATIONS = ("kvpress", "authors")


@register
@dataclass
class AdaKV(HeadAdaptiveMethod):
    method = "adakv"
    display_name = "AdaKV"
    kvpress_entries = {"adakv_snapkv": {"placements": ("agnostic", "aware")},
                       # kvpress's "expected_attention" entry: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
                       "expected_attention": {"scorer": "expected_attention", "scorer_epsilon": 0.01}}
    paper = "Ada-KV, arXiv 2407.11550"
    reference = ("kvpress 0.5.5 `AdaKVPress(SnapKVPress())` (window 64, kernel 5, average pooling; "
                 "`alpha_safeguard=0.2`; `scorer=` any scoring method)")
    budget_meaning = ("tokens per KV head **on average**: the layer's total is the budget x KV heads, each head its "
                      "own count")
    deviations = "stored per head, not masked (below); the authors' allocation differs (below)"
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "a{alpha_safeguard}", "se{scorer_epsilon}",
                 "{allocation}")
    scorer: str = "snapkv"  # kvpress's AdaKVPress(SnapKVPress()): its SnapKV scores
    allocation: str = "kvpress"

    def validate(self) -> None:
        super().validate()
        check_choice("allocation", self.allocation, ALLOCATIONS)

    def keep(self, ctx, scores, n_kept: int, held=None):
        def row(row_scores, rows, first):
            return adakv_keep(row_scores, min(n_kept, row_scores.shape[-1]), self.alpha_safeguard,
                              None if held is None else held[rows, :, first:])
        return per_row_keep(scores, ctx.pad_mask, row)

    def cannot_decode(self) -> str:
        if self.allocation == "authors":
            return "allocation=authors splits a prompt's window from its earlier positions; use kvpress"
        return super().cannot_decode()

    def ranking_scores(self, ctx):
        """kvpress's allocation ranks the scorer's scores, each head's safeguarded top raised to the maximum, over all
        the layer's heads at once (one prompt; the authors' allocation: None)."""
        if self.allocation != "kvpress" or ctx.pad_mask is not None:
            return None
        length = ctx.keys.shape[-2]
        n_kept = min(self.layer_budget(ctx.layer_idx, ctx.num_layers, length), length)
        return safeguarded(self.prompt_scores(ctx).clone(), n_kept, self.alpha_safeguard)

    def ranking_bounds(self, ctx, scores, tolerance: float) -> tuple:
        """The scorer's."""
        return self.scorer_config().ranking_bounds(ctx, scores, tolerance)

    def select(self, ctx, budget: int, window: int):
        if self.allocation == "kvpress":
            return super().select(ctx, budget, window)
        # the authors': budget - window earlier positions per head on average, then the window
        earlier = self.prompt_scores(ctx)[..., :-self.window]

        def row(row_scores, rows, first):
            n_past = max(0, min(budget - self.window, row_scores.shape[-1]))  # a ratio may leave the window only
            return authors_keep(row_scores, n_past, self.alpha_safeguard)
        keep = per_row_keep(earlier, ctx.pad_mask, row)
        return pack(F.pad(keep, (0, self.window), value=True))
