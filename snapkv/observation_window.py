"""What the methods scoring by the observation window share (SnapKV, PyramidKV, TOVA, AdaKV's default
scorer): the window's attention over the earlier positions, computed once per layer and prefill for every
setting with the same window, and the SnapKV-family fields (kernel, pooling, GQA reduction)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError, check_choice, check_int
from .memory import window_scores_bytes
from .method import POOLINGS, Method
from .select import aggregate_heads, pool, window_attention


def window_votes(ctx, window: int):
    """The observation window's attention over the earlier positions, ``(sum, mean)`` over its queries
    (``[b, H, L - window]`` each; the official SnapKV sums, kvpress averages), computed once per layer
    and prefill for every setting with this window (budgets, kernels, poolings, TOVA, AdaKV's scorer)."""
    return ctx.shared(("window_attention", window), lambda: window_attention(
        ctx.queries(window), ctx.keys, window, ctx.pad_mask, ctx.form, reduce="both"))


@dataclass
class WindowVoteMethod(Method):
    """The window's summed attention, pooled with ``kernel``, reduced over each KV group (``gqa``). The
    defaults are the paper's LongBench setting (the official SnapKV LongBench configs): window 32, kernel
    7, max pooling."""

    tag_parts = ("w{window}", "k{kernel}", "{pooling}", "{gqa}")
    budget: int = 1024
    window: int = 32
    kernel: int = 7
    pooling: str = "maxpool"
    gqa: str = "mean"

    def validate(self) -> None:
        super().validate()
        check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InputError(f"kernel={self.kernel} must be odd (pooling keeps the length with padding kernel // 2)")
        check_choice("pooling", self.pooling, POOLINGS)

    def score(self, ctx):
        votes, _ = window_votes(ctx, self.window)
        return aggregate_heads(pool(votes, self.pooling, self.kernel), ctx.keys.shape[1], self.gqa)

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return self.window  # the window's queries

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return window_scores_bytes(shape, self.window, length, batch, nbytes)
