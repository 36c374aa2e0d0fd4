"""Random selection plus the recent window: the sanity floor every real method must beat."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..method import Method
from ..registry import register
from ..memory import votes_bytes


@register
@dataclass
class RandomKeep(Method):
    method = "random"
    display_name = "Random"
    kvpress_entries = {"random": {"parity": "not comparable: ours keeps the window and draws with its own seed"}}
    reference = "none: random earlier positions and the window, a sanity floor"
    budget_meaning = "random earlier positions + window"
    deviations = "a sanity floor; draws depend on the batch shape"
    tag_parts = ("w{window}", "s{seed}")
    untagged = ("gqa",)  # the draw is per KV head whatever gqa says
    seed: int = 0

    def score(self, ctx):
        keys = ctx.keys
        b, n_kv, length, _ = keys.shape
        generator = torch.Generator().manual_seed(self.seed * 100_003 + ctx.layer_idx)
        return torch.rand(b, n_kv, length - self.window, generator=generator).to(keys.device)

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # no input at all

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return votes_bytes(shape, length, batch)
