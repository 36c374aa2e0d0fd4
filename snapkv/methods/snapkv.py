"""SnapKV (arXiv 2404.14469): the observation window votes for the positions every head keeps."""
from __future__ import annotations

from dataclasses import dataclass

from ..method import Method, InputError, POOLINGS, check_choice, check_int, register
from ..memory import window_scores_bytes
from ..select import aggregate_heads, pool, window_attention


@register
@dataclass
class SnapKV(Method):
    """Defaults are the paper's LongBench setting (the official SnapKV LongBench configs): window 32,
    kernel 7, max pooling."""

    method = "snapkv"
    display_name = "SnapKV"
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
        # the window's attention is shared by every budget, kernel and pooling of one prefill
        votes = ctx.shared(("window_attention", self.window), lambda: window_attention(
            ctx.queries(self.window), ctx.keys, self.window, ctx.pad_mask, ctx.scaling))
        return aggregate_heads(pool(votes, self.pooling, self.kernel), ctx.keys.shape[1], self.gqa)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return window_scores_bytes(shape, self.window, length, batch, nbytes)
