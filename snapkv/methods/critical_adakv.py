"""CriticalAdaKV (Feng et al., arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an
Output Perturbation Perspective"): AdaKV whose scores are weighted by how much each value moves the
layer's output, ``||v W_O||_1``.

As kvpress 0.5.5 ``CriticalAdaKVPress(SnapKVPress())`` runs it (``snapkv.head_budgets``), with its
defaults ``epsilon=1e-4`` and ``first_stage_ratio=0.5``: AdaKV's safeguard; each head's budget from one
top-k across heads; a first stage keeping each head's top ``first_stage_ratio`` of its budget by the
scorer; a second by ``(score + epsilon) * ||v W_O||_1``; the bottom-k across heads evicted. Stored as
AdaKV stores it (each head's kept positions only, ``snapkv.ragged``). kvpress sums the
heads' budgets over the batch; here each batch row has its own (equal at batch 1, its protocol).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import check_number
from ..head_budgets import HeadAdaptiveMethod, critical_adakv_keep, per_row_keep
from ..registry import register


@register
@dataclass
class CriticalAdaKV(HeadAdaptiveMethod):
    method = "critical_adakv"
    display_name = "CriticalAdaKV"
    kvpress_entries = {"critical_adakv_snapkv": {}}
    paper = "CriticalKV, arXiv 2502.03805"
    reference = "kvpress 0.5.5 `CriticalAdaKVPress(SnapKVPress())` (`epsilon=1e-4`, `first_stage_ratio=0.5`)"
    budget_meaning = "as `adakv`"
    deviations = "per batch row budgets (kvpress sums them over the batch; equal at batch 1)"
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "a{alpha_safeguard}", "se{scorer_epsilon}",
                 "e{epsilon}", "fs{first_stage_ratio}")
    keep_reads_values = True  # the second stage weighs each slot by its value's projected norm
    scorer: str = "snapkv"  # kvpress's AdaKVPress(SnapKVPress()): its SnapKV scores
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def validate(self) -> None:
        super().validate()
        self.epsilon = check_number("epsilon", self.epsilon, 0)
        self.first_stage_ratio = check_number("first_stage_ratio", self.first_stage_ratio, 0, 1)

    def keep(self, ctx, scores, n_kept: int, held=None):
        def row(row_scores, rows, first):
            n = row_scores.shape[-1]
            values = ctx.values[rows, :, first:]
            return critical_adakv_keep(row_scores, min(n_kept, n), self.alpha_safeguard, values, ctx.attn,
                                       self.epsilon, self.first_stage_ratio,
                                       None if held is None else held[rows, :, first:])
        return per_row_keep(scores, ctx.pad_mask, row)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """AdaKV's, and one query head's values times ``W_O`` (``[L, hidden]``) with its norms."""
        return super().compression_bytes(shape, length, batch, nbytes) + \
            batch * length * (shape.hidden + shape.heads) * max(nbytes, 4) + batch * shape.heads * length * 4
