"""Knorm (Devoto et al., arXiv 2406.11430, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): each KV head keeps the keys of lowest L2 norm.

As kvpress 0.5.5 ``KnormPress`` scores it: minus the key's norm, accumulated in at least float32 (a
half-precision norm would tie distinct positions); no window, no sinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import votes_bytes
from ..registry import register
from ..prompt_scores import WholePromptMethod


@register
@dataclass
class Knorm(WholePromptMethod):
    method = "knorm"
    display_name = "Knorm"
    kvpress_entries = {"knorm": {}}
    paper = "Devoto et al., arXiv 2406.11430"
    reference = "kvpress 0.5.5 `KnormPress` (minus the key's L2 norm, in at least float32)"
    budget_meaning = "tokens kept per KV head, no window"
    deviations = "none (parity-tested)"
    scores_positions = True

    def score(self, ctx):
        keys = ctx.keys
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # the keys alone

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return votes_bytes(shape, length, batch)
