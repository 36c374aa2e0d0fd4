"""KeyDiff (Park et al., arXiv 2504.15364, "KeyDiff: Key Similarity-Based KV Cache Eviction"): each KV
head keeps the keys least similar to its mean key direction.

As kvpress 0.5.5 ``KeyDiffPress`` scores it, in one shot over the prompt: the anchor is the mean of the
L2-normalised keys, the score minus each key's cosine similarity to it. The paper evicts block by
block as the prompt streams in (kvpress: ``BlockPress(KeyDiffPress)``): that variant is ``compressor=block``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..memory import votes_bytes
from ..registry import register
from ..prompt_scores import WholePromptMethod, by_real_rows


def keydiff_scores(keys):
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


@register
@dataclass
class KeyDiff(WholePromptMethod):
    method = "keydiff"
    display_name = "KeyDiff"
    kvpress_entries = {"keydiff": {}}
    paper = "KeyDiff, arXiv 2504.15364"
    reference = "kvpress 0.5.5 `KeyDiffPress` (minus the cosine similarity to the mean normalised key)"
    budget_meaning = "tokens per KV head, no window"
    deviations = "one shot over the prompt (the paper: block by block, which is `compressor=block`)"
    scores_positions = True

    def score(self, ctx):
        return by_real_rows(ctx.pad_mask, lambda rows, first: keydiff_scores(ctx.keys[rows, :, first:]))

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # the keys alone

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The normalised keys of one layer and the cosine similarities' products."""
        return 2 * batch * shape.kv_heads * length * shape.head_dim * nbytes + votes_bytes(shape, length, batch)
