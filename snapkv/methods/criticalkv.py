"""CriticalKV (Feng et al., arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective"): a scorer's ranking re-weighted by how much each value moves the layer's output,
``||v W_O||_1``, every head keeping as many positions (the uniform variant; ``critical_adakv`` is the
head-adaptive one).

As kvpress 0.5.5 ``CriticalKVPress(SnapKVPress())`` runs it (its registry entry ``critical_snapkv``), with
its defaults ``epsilon=1e-4`` and ``first_stage_ratio=0.5``: the wrapped scorer (``scorer=``, kvpress's
SnapKV by default: window 64, kernel 5, average pooling, the mean over each KV group, its window above every
other position) ranks every position; a first stage keeps each head's top
``int((1 - ratio) * L * first_stage_ratio)`` (at least 1; with ``budget``: ``int(budget *
first_stage_ratio)``) by that score; the rest is chosen by ``(score + epsilon) * ||v W_O||_1``
(``snapkv.head_budgets.value_output_norms``); each head keeps its top ``int(L * (1 - ratio))`` (or
``budget``), the first stage's among them. The window is not kept unconditionally (kvpress's neither).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, check_number
from ..head_budgets import value_output_norms
from ..registry import register
from ..wrapping import WrapperMethod


@register
@dataclass
class CriticalKV(WrapperMethod):
    method = "criticalkv"
    display_name = "CriticalKV"
    kvpress_entries = {"critical_snapkv": {}}
    paper = "CriticalKV, arXiv 2502.03805"
    reference = ("kvpress 0.5.5 `CriticalKVPress(SnapKVPress())` (window 64, kernel 5, average pooling; "
                 "`epsilon=1e-4`, `first_stage_ratio=0.5`; `scorer=` any scoring method)")
    budget_meaning = "tokens kept per KV head, the scorer's window not guaranteed"
    deviations = ("each batch row on its own real tokens (kvpress has no padding); a prompt not longer than the "
                  "scorer's window is kept whole (kvpress refuses it)")
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "se{scorer_epsilon}", "e{epsilon}",
                 "fs{first_stage_ratio}")
    scorer: str = "snapkv"        # kvpress's CriticalKVPress(SnapKVPress())
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def validate(self) -> None:
        self.check_scorer_fields()
        self.epsilon = check_number("epsilon", self.epsilon, 0)
        self.first_stage_ratio = check_number("first_stage_ratio", self.first_stage_ratio, 0, 1)
        if self.ratio is None and self.budget <= self.window:
            raise InputError(f"budget={self.budget} must be larger than window={self.window}")

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # a prompt not longer than the scorer's window is kept whole (kvpress's SnapKV refuses it)
        if length <= self.scorer_window(layer_idx, num_layers, length):
            return length
        return self.budget_for(length)

    def first_stage(self, length: int) -> int:
        """Positions each head keeps by the scorer alone (``CriticalKVPress.score``'s ``selection_budget``)."""
        kept = (1 - self.ratio) * length * self.first_stage_ratio if self.ratio is not None \
            else self.budget * self.first_stage_ratio
        return max(1, int(kept)) if self.first_stage_ratio > 0 else 0

    def critical_scores(self, ctx) -> torch.Tensor:
        """``[b, kv_heads, n]``: the scores ``CriticalKVPress.score`` gives (the first stage's at the dtype's
        maximum)."""
        scores = self.scorer_config().prompt_scores(ctx)
        first = torch.topk(scores, self.first_stage(ctx.keys.shape[-2]), sorted=True, dim=-1).indices
        scores = (scores + self.epsilon) * value_output_norms(ctx.values, ctx.attn)
        return scores.scatter_(-1, first, torch.finfo(scores.dtype).max)

    def row_keep(self, ctx) -> torch.Tensor:
        """``[1, kv_heads, n]`` bool: what each head keeps of one row's ``n`` real positions (``ctx``: that
        row's context)."""
        n = ctx.keys.shape[-2]
        keep = torch.zeros(1, ctx.keys.shape[1], n, dtype=torch.bool, device=ctx.keys.device)
        if self.layer_budget(ctx.layer_idx, ctx.num_layers, n) >= n:
            return keep.fill_(True)
        return keep.scatter_(-1, self.critical_scores(ctx).topk(self.budget_for(n), dim=-1).indices, True)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scorer's term, one query head's values times ``W_O`` (``[L, hidden]``) with every head's norms,
        the re-weighted scores, and the kept mask with its ordering."""
        scorer = self.scorer_config().compression_bytes(shape, length, batch, nbytes)
        norms = batch * length * (shape.hidden + shape.heads) * max(nbytes, 4) + batch * shape.heads * length * 4
        return scorer + norms + batch * shape.kv_heads * length * (4 + 1 + 8)
