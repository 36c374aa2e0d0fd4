"""AdaKV (Feng et al., arXiv 2407.11550, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation"): a layer's budget (KV heads x the per-head budget) goes to the positions a scorer ranks
highest across all its KV heads at once, each head keeping at least ``alpha_safeguard`` of its share.

As kvpress 0.5.5 ``AdaKVPress(SnapKVPress())`` runs it by default (``snapkv.head_budgets``): the scorer
is kvpress's SnapKV (the window's attention averaged over its queries, average pooling of ``kernel``,
averaged over each KV group, the window itself always kept); ``scorer=`` takes any method that scores
positions instead. kvpress keeps every key and masks the evicted ones;
here each head stores only what it keeps, the layer padded to its longest head (the padding is never
attended to), so ``kv_cache_bytes`` is what is held.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError, check_choice, check_int
from ..head_budgets import adakv_keep, pack, per_row_keep
from ..memory import window_scores_bytes
from ..method import POOLINGS, Method, register
from ..prompt_scores import always_kept
from ..select import aggregate_heads, pool
from .snapkv import window_votes

SCORERS = ("snapkv", "tova", "knorm", "keydiff", "expected_attention", "h2o")


@register
@dataclass
class AdaKV(Method):
    method = "adakv"
    display_name = "AdaKV"
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "a{alpha_safeguard}")
    head_adaptive = True
    budget: int = 1024
    window: int = 64
    kernel: int = 5
    pooling: str = "avgpool"
    gqa: str = "mean"
    scorer: str = "snapkv"
    alpha_safeguard: float = 0.2

    def validate(self) -> None:
        check_int("window", self.window, 1)
        self.check_budget_or_ratio()
        check_choice("gqa", self.gqa, ("mean", "max"))
        check_choice("scorer", self.scorer, SCORERS)
        check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InputError(f"kernel={self.kernel} must be odd (pooling keeps the length with padding kernel // 2)")
        check_choice("pooling", self.pooling, POOLINGS)
        alpha = self.alpha_safeguard
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise InputError(f"alpha_safeguard={alpha!r} must be a number in [0, 1]: the share of its uniform "
                             "budget each head keeps at least")
        self.alpha_safeguard = float(alpha)

    def budget_for(self, length: int) -> int:
        """Tokens per KV head on average: ``budget``, or kvpress's ``compute_n_kept`` (at least 1)."""
        return self.budget if self.ratio is None else max(1, int(length * (1 - self.ratio)))

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # the scorer's window must fit before the prompt's end (kvpress asserts it): else keep all
        return length if length <= self.window else self.budget_for(length)

    def stored_tokens(self, layer_idx: int, num_layers: int, length: int, heads: int) -> int:
        """The longest head's most (a layer is stored padded to it): the layer's total less every other
        head's safeguard. An upper bound; what a prompt stores is ``kv_cache_bytes`` of its cache."""
        n_kept = self.layer_budget(layer_idx, num_layers, length)
        safe = max(1, int(n_kept * self.alpha_safeguard)) if self.alpha_safeguard > 0 else 0
        return min(length, n_kept * heads - (heads - 1) * safe)

    def scorer_config(self) -> Method:
        from ..method import build_config
        return build_config(self.scorer, window=self.window, kernel=self.kernel, pooling=self.pooling, gqa=self.gqa)

    def prompt_scores(self, ctx):
        """``[b, kv_heads, L]``: the scorer's ranking of every prompt position (its window, if any,
        above every other position)."""
        if self.scorer == "snapkv":  # kvpress's SnapKVPress: the window's mean attention
            _, votes = window_votes(ctx, self.window)
            scores = aggregate_heads(pool(votes, self.pooling, self.kernel), ctx.keys.shape[1], self.gqa)
            return always_kept(scores, last=self.window)
        scorer = self.scorer_config()
        length = ctx.keys.shape[-2]
        return always_kept(scorer.score(ctx), last=scorer.recent_window(ctx.layer_idx, ctx.num_layers, length))

    def keep(self, ctx, scores, n_kept: int):
        """``[b, kv_heads, L]`` bool: what each head keeps."""
        def row(row_scores, row, first):
            n = row_scores.shape[-1]
            return adakv_keep(row_scores, min(n_kept, n), self.alpha_safeguard)
        return per_row_keep(scores, ctx.pad_mask, row)

    def select(self, ctx, budget: int, window: int):
        return pack(self.keep(ctx, self.prompt_scores(ctx), budget))

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scorer's term (SnapKV's window vote by default), then per KV head and position: the padded
        scores, a row's copy and its negation, the bottom-k's indices, the kept mask and its ordering."""
        scorer = window_scores_bytes(shape, self.window, length, batch, nbytes) if self.scorer == "snapkv" \
            else self.scorer_config().compression_bytes(shape, length, batch, nbytes)
        return scorer + batch * shape.kv_heads * length * (4 * 3 + 8 * 2 + 1)
