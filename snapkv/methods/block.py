"""Block-wise compression (Park et al., arXiv 2504.15364, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference in Resource-Constrained Environments"): the prompt is taken block by
block, as if it streamed in, and after each block every KV head keeps the top ``n_kept`` of what it holds.

As kvpress 0.5.5 ``BlockPress(press=KeyDiffPress(), block_size=128)`` runs it (its registry entry
``block_keydiff``): each head starts from the first ``n_kept`` positions (``int(L * (1 - ratio))``, or
``budget``); for each next block of ``block_size`` positions, the wrapped scorer (``scorer=``, KeyDiff by
default) scores the head's kept positions followed by the block, in that order, as a prompt of its own (its
keys, values and hidden states restricted to them; kvpress splits the hidden states into one slice per KV
head, each gathered at its head's positions), and the head keeps the top ``n_kept``. Every position is
computed in one prefill beforehand (kvpress: "not a true chunked prefill"), so the scores differ from a
streamed prefill only through the attention that produced the keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, check_int
from ..registry import register
from ..wrapping import WrapperMethod, narrowed


@register
@dataclass
class Block(WrapperMethod):
    method = "block"
    display_name = "Block"
    kvpress_entries = {"block_keydiff": {}}
    paper = "KeyDiff, arXiv 2504.15364 (block-wise eviction)"
    reference = "kvpress 0.5.5 `BlockPress(press=KeyDiffPress(), block_size=128)` (`scorer=` any scoring method)"
    budget_meaning = "tokens per KV head (`n_kept`), no window of its own"
    deviations = "each batch row on its own real tokens (kvpress has no padding)"
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "se{scorer_epsilon}", "bs{block_size}")
    scorer: str = "keydiff"       # kvpress's BlockPress(press=KeyDiffPress())
    block_size: int = 128

    def validate(self) -> None:
        self.check_scorer_fields()
        check_int("block_size", self.block_size, 1)
        scorer_window = self.scorer_config().window
        if self.ratio is None and self.budget <= scorer_window:
            raise InputError(f"budget={self.budget} must be larger than the scorer's window={scorer_window}")

    def prefill_rows(self, length: int, question_tokens: int | None) -> None:
        return None  # every position's hidden states, gathered block by block

    def check_turn(self, ctx) -> None:
        """A later turn (``compress_later_turns``) cannot be taken block by block: kvpress's ``BlockPress``
        gathers the hidden states of the positions it scores, which a later turn does not have."""
        if ctx.pass_tokens != ctx.keys.shape[-2]:
            raise InputError("block: a later turn cannot be compressed (its earlier positions have no hidden states "
                             "to score them block by block); compress_later_turns=False appends it as it is")

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # a prompt not longer than the scorer's window is kept whole (kvpress's SnapKV refuses it)
        if length <= self.scorer_window(layer_idx, num_layers, length):
            return length
        return self.budget_for(length)

    def row_keep(self, ctx) -> torch.Tensor:
        """``[1, kv_heads, n]`` bool: what each head keeps of one row's ``n`` real positions (``ctx``: that
        row's context), as ``BlockPress.compress`` chooses it."""
        keys, values, hidden = ctx.keys, ctx.values, ctx.hidden_states
        rows, heads, n, head_dim = keys.shape
        keep = torch.zeros(rows, heads, n, dtype=torch.bool, device=keys.device)
        n_kept = self.budget_for(n)
        if self.layer_budget(ctx.layer_idx, ctx.num_layers, n) >= n:
            return keep.fill_(True)
        scorer = self.scorer_config()
        window = self.scorer_window(ctx.layer_idx, ctx.num_layers, n)
        block = min(self.block_size, n)
        kept = torch.arange(n_kept, device=keys.device).expand(rows, heads, -1)
        states = hidden.reshape(rows, n, heads, -1).transpose(1, 2)  # one slice of the hidden size per KV head
        for start in range(n_kept, n, block):
            end = min(start + block, n)
            current = torch.cat([kept, torch.arange(start, end, device=keys.device).expand(rows, heads, -1)], dim=-1)
            if current.shape[-1] <= window:
                raise InputError(f"block: a block's context ({current.shape[-1]} positions) is not longer than the "
                                 f"scorer's window={window} (kvpress refuses it); keep more tokens")
            part_states = states.gather(2, current.unsqueeze(-1).expand(-1, -1, -1, states.shape[-1]))
            part_states = part_states.transpose(1, 2).reshape(rows, -1, hidden.shape[-1])
            at = current.unsqueeze(-1).expand(-1, -1, -1, head_dim)
            part = narrowed(ctx, keys=keys.gather(2, at), values=values.gather(2, at), hidden_states=part_states,
                            pad_mask=None)
            scores = scorer.prompt_scores(part)
            kept = current.gather(-1, scores.topk(n_kept, dim=-1).indices)
        return keep.scatter_(-1, kept, True)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scorer's term on a block's context (at most the prompt), that context's keys, values and two
        copies of its hidden states, its positions, and the kept mask with its ordering."""
        scorer = self.scorer_config().compression_bytes(shape, length, batch, nbytes)
        context = batch * length * (2 * shape.kv_heads * shape.head_dim + 2 * shape.hidden) * nbytes
        return scorer + context + batch * shape.kv_heads * length * (8 * 3 + 1 + 8)
