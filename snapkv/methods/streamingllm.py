"""StreamingLLM (arXiv 2309.17453) applied once at prefill: attention sinks plus recent tokens.

Keeps the first ``sink_tokens`` real tokens (4, the paper's setting) and the last
``budget - sink_tokens``, as KVCache-Factory ``run_longbench.py`` sets it. Keys keep the
RoPE positions they were computed with (the original re-indexes positions inside its rolling
cache; a prompt compressed once has no need to).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, check_int
from ..method import Method
from ..registry import register
from ..memory import votes_bytes


@register
@dataclass
class StreamingLLM(Method):
    method = "streamingllm"
    display_name = "StreamingLLM"
    kvpress_entries = {"streaming_llm": {}}
    paper = "StreamingLLM, arXiv 2309.17453"
    reference = "KVCache-Factory's setting (4 sinks, window = budget - 4), applied once at prefill"
    budget_meaning = "sinks + most recent"
    deviations = "keys keep their original RoPE positions"
    tag_parts = ("s{sink_tokens}",)
    scores_positions = True
    untagged = ("gqa",)  # sinks and recent tokens are the same for every head
    derived = ("window",)
    budget: int = 1024
    sink_tokens: int = 4
    window: int = 0  # derived: budget - sink_tokens

    def validate(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 1)
        self.check_budget_or_ratio()
        if self.ratio is None:
            if self.sink_tokens >= self.budget:
                raise InputError(f"sink_tokens={self.sink_tokens} must be smaller than budget={self.budget}")
            self.window = self.budget - self.sink_tokens
        else:
            self.window = 0

    def budget_for(self, length: int) -> int:
        if self.ratio is None:
            return self.budget
        return max(int(length * (1 - self.ratio)), self.sink_tokens + 1)

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        return self.budget_for(length) - self.sink_tokens

    def score(self, ctx):
        keys = ctx.keys
        b, n_kv, length, _ = keys.shape
        n = length - self.recent_window(ctx.layer_idx, ctx.num_layers, length)
        if ctx.pad_mask is None:
            first_real = torch.zeros(b, 1, dtype=torch.long, device=keys.device)
        else:
            first_real = (~ctx.pad_mask).sum(dim=1, keepdim=True)
        rank = torch.arange(n, device=keys.device)[None, :] - first_real
        votes = ((rank >= 0) & (rank < self.sink_tokens)).float()
        return votes[:, None, :].expand(b, n_kv, n)

    def prompt_scores(self, ctx):
        """kvpress's ``StreamingLLMPress.score``: 1 for every slot but the ``L - budget`` after the first
        ``sink_tokens``, which get 0; ``topk`` then breaks the ties. Cutting while decoding ranks the cache's slots
        with it, as kvpress's ``DecodingPress`` does: its cache holds them in ``topk``'s order, so the next cut's
        first slots need not be the prompt's first tokens (kvpress's behaviour, kept; ``docs/decoding.md``)."""
        keys = ctx.keys
        b, n_kv, length, _ = keys.shape
        pruned = length - min(length, self.budget_for(length))
        if ctx.pad_mask is None:
            first_real = torch.zeros(b, 1, dtype=torch.long, device=keys.device)
        else:
            first_real = (~ctx.pad_mask).sum(dim=1, keepdim=True)
        rank = torch.arange(length, device=keys.device)[None, :] - first_real
        kept = (rank >= 0) & ((rank < self.sink_tokens) | (rank >= self.sink_tokens + pruned))
        return kept.to(keys.dtype)[:, None, :].expand(b, n_kv, length)

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # positions alone

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return votes_bytes(shape, length, batch)
