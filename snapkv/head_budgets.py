"""Head-adaptive budgets (AdaKV, CriticalAdaKV): one layer's kept positions chosen across all its KV
heads at once, so heads keep different numbers of positions at the same total.

Each step follows kvpress 0.5.5 (``AdaKVPress.compress``, ``CriticalAdaKVPress.compress``) on one batch
row: ``scores`` ``[1, heads, n]`` rank every position of the row's prompt, ``n_kept`` is the average per
head. kvpress masks what it evicts and keeps it in memory; here the kept positions are returned and the
cache stores only those, each head's own (``snapkv.ragged``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


from .architectures import output_projection, reading
from .errors import InputError, check_number
from .method import Method
from .prompt_scores import by_real_rows
from .select import pack
from .wrapping import ScorerWrapper


def safeguarded(scores: torch.Tensor, n_kept: int, alpha: float, held: torch.Tensor | None = None) -> torch.Tensor:
    """Each head's top ``int(n_kept * alpha)`` (at least 1 when ``alpha > 0``) raised to the dtype's
    maximum, so every head keeps at least that many (in place; returns ``scores``). ``held`` ``[rows, heads, n]``:
    the slots each head holds (a cut while decoding of a ragged layer; the others score ``-inf``): a head holding
    fewer than that keeps what it holds."""
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    top = torch.topk(scores, n_safe, dim=-1).indices
    highest = torch.full_like(top, 0, dtype=scores.dtype).fill_(torch.finfo(scores.dtype).max)
    if held is not None:
        highest = torch.where(held.gather(-1, top), highest, scores.gather(-1, top))
    return scores.scatter_(-1, top, highest)


def pruned_across_heads(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """``[rows, heads, n]`` bool, True where kept: the ``heads * (n - n_kept)`` lowest scores of each row,
    over all its heads at once, are evicted (kvpress's bottom-k, ties broken as its ``topk``)."""
    rows, heads, n = scores.shape
    n_pruned = heads * (n - n_kept)
    pruned = torch.topk(-scores.reshape(rows, -1), n_pruned, dim=1).indices
    keep = torch.ones(rows, heads * n, dtype=torch.bool, device=scores.device)
    return keep.scatter_(1, pruned, False).view(rows, heads, n)


def adakv_keep(scores: torch.Tensor, n_kept: int, alpha: float, held: torch.Tensor | None = None) -> torch.Tensor:
    """AdaKV: the safeguard, then the bottom-k across heads (``held``: see ``safeguarded``; a slot no head holds
    is never kept when they hold more than ``n_kept`` each on average)."""
    if held is not None:
        scores = scores.masked_fill_(~held, float("-inf"))
    return pruned_across_heads(safeguarded(scores, n_kept, alpha, held), n_kept)


def authors_keep(scores: torch.Tensor, n_past: int, alpha: float) -> torch.Tensor:
    """AdaKV as its authors' code allocates (FFY0/AdaKV ``adaptive_snapkv``), on the earlier positions:
    each head's count ``c_h`` from one top-k of ``heads * n_past`` over all heads, then each head keeps
    its own top ``round(c_h * (1 - alpha) + int(alpha * n_past))``."""
    rows, heads, n = scores.shape
    top = torch.topk(scores.reshape(rows, -1), heads * n_past, dim=-1).indices
    counts = torch.bincount((top // n).flatten(), minlength=heads)
    caps = torch.round(counts * (1 - alpha) + int(alpha * n_past)).to(torch.int64).clamp(max=n).tolist()
    keep = torch.zeros(rows, heads, n, dtype=torch.bool, device=scores.device)
    for head, cap in enumerate(caps):
        keep[:, head].scatter_(-1, torch.topk(scores[:, head], cap, dim=-1).indices, True)
    return keep


def value_output_norms(values: torch.Tensor, attn) -> torch.Tensor:
    """``||v W_O||_1`` of each position per query head, averaged over each KV group ``[b, kv, n]``
    (kvpress's ``CriticalKVPress.vwl1norm``: one query head at a time, never every head's product)."""
    b, n_kv, n, _ = values.shape
    config, probe = attn.config, reading(attn)
    heads = probe.query_heads
    out_weight = output_projection(attn).weight.transpose(0, 1).view(heads, probe.head_dim, config.hidden_size)
    repeated = values.repeat_interleave(heads // n_kv, dim=1)
    norms = [torch.norm(repeated[:, head].matmul(out_weight[head].unsqueeze(0)), p=1, dim=-1)
             for head in range(heads)]
    return torch.stack(norms, dim=1).view(b, n_kv, heads // n_kv, n).mean(dim=2)


def critical_adakv_keep(scores: torch.Tensor, n_kept: int, alpha: float, values: torch.Tensor, attn,
                        epsilon: float, first_stage_ratio: float, held: torch.Tensor | None = None) -> torch.Tensor:
    """CriticalAdaKV: the safeguard; each head's budget from one top-k across heads; a first stage that
    keeps each head's top ``first_stage_ratio`` of its budget by score; a second stage by score times
    the projected value norm; then the bottom-k across heads (``held``: see ``adakv_keep``)."""
    if held is not None:
        scores = scores.masked_fill_(~held, float("-inf"))
    scores = safeguarded(scores, n_kept, alpha, held)
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
    if held is not None:  # -inf times a padded value's zero norm
        scores = scores.masked_fill_(~held, float("-inf"))
    budgets = head_budgets.tolist()
    ranked = torch.topk(scores, max(budgets), sorted=True, dim=-1).indices
    for head in range(heads):
        scores[:, head, :].scatter_(-1, ranked[:, head, :budgets[head]], highest)
    return pruned_across_heads(scores, n_kept)


def per_row_keep(scores: torch.Tensor, pad_mask: torch.Tensor | None, keep_row) -> torch.Tensor:
    """``keep_row(row_scores, rows, first)`` -> the kept mask ``[rows, heads, n - first]``, one batch row
    at a time on its real tokens (from ``first``, its padding), as the allocation ranks one row; padded
    positions are never kept."""
    if pad_mask is None:
        pad_mask = torch.ones(scores.shape[0], scores.shape[-1], dtype=torch.bool, device=scores.device)
    return by_real_rows(pad_mask, lambda rows, first: keep_row(scores[rows, :, first:].clone(), rows, first),
                        fill=False)


@dataclass
class HeadAdaptiveMethod(ScorerWrapper, Method):
    """What AdaKV and CriticalAdaKV share: kvpress's SnapKV as the default scorer (``scorer=`` any method
    that scores positions), the per-head average budget, its safeguard, and storage per head."""

    head_adaptive = True
    # whether ``keep`` reads ``ctx.values`` (CriticalAdaKV's value norms): a cut of a ragged layer while decoding
    # then pads a row's values to its longest head for it
    keep_reads_values: ClassVar[bool] = False
    budget: int = 1024
    window: int = 64
    kernel: int = 5
    pooling: str = "avgpool"
    gqa: str = "mean"
    scorer: str = ""              # the wrapped method (each wrapper's file gives its default)
    alpha_safeguard: float = 0.2
    scorer_epsilon: float = 0.0   # scorer=expected_attention: its epsilon (kvpress's leaderboard entry: 0.01)

    def validate(self) -> None:
        self.check_scorer_fields()
        self.alpha_safeguard = check_number("alpha_safeguard", self.alpha_safeguard, 0, 1,
                                            "the share of its uniform budget each head keeps at least")
        if self.ratio is None and self.budget <= self.window:
            raise InputError(f"budget={self.budget} must be larger than window={self.window}")

    def budget_for(self, length: int) -> int:
        """Tokens per KV head on average: ``budget``, or kvpress's ``compute_n_kept`` (at least 1)."""
        return self.budget if self.ratio is None else max(1, int(length * (1 - self.ratio)))

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # the scorer's window must fit before the prompt's end (kvpress asserts it): else keep all
        return length if length <= self.window else self.budget_for(length)

    def prompt_scores(self, ctx) -> torch.Tensor:
        """``[b, kv_heads, L]``: the scorer's ranking of every prompt position (its window, if any,
        above every other position)."""
        return self.scorer_config().prompt_scores(ctx)

    def keep(self, ctx, scores: torch.Tensor, n_kept: int, held: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, kv_heads, L]`` bool: what each head keeps of ``scores`` at ``n_kept`` per head on average.
        ``held`` ``[b, kv_heads, L]``: the slots each head holds, where heads hold different numbers (a cut while
        decoding of a ragged layer, ``snapkv.decoding_cuts.cut_heads``; the others score ``-inf`` and are never
        kept); None: every slot."""
        raise NotImplementedError

    def cannot_decode(self) -> str:
        return super().cannot_decode() or self.scorer_config().cannot_decode()

    def select(self, ctx, budget: int, window: int):
        return pack(self.keep(ctx, self.prompt_scores(ctx), budget))

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scorer's term (SnapKV's window vote by default), then per KV head and position: the padded
        scores, a row's copy and its negation, the bottom-k's indices, the kept mask and its ordering."""
        scorer = self.scorer_config().compression_bytes(shape, length, batch, nbytes)
        return scorer + batch * shape.kv_heads * length * (4 * 3 + 8 * 2 + 1)
