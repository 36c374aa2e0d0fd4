"""Observed attention (kvpress 0.5.5 ``ObservedAttentionPress``, registry entry ``observed_attention``; related
to H2O, Zhang et al., arXiv 2306.14048): each KV head keeps the positions the prompt itself attended to most.

As kvpress scores it: the prefill's own attention weights (``ctx.attention_weights()``: every query's softmax
over the keys, as eager attention computes it; kvpress needs ``attn_implementation="eager"``), summed over the
queries in the model dtype, divided by the number of queries that can see each position (``L - j`` for
position ``j``: the average attention it receives), averaged over each KV group's query heads; the top
``int(L * (1 - ratio))`` (at least 1) are kept, no window, no sinks. With an eager model the weights are the
attention module's own; with sdpa (which returns none) the hooks compute them again, one block of query rows
at a time, from the module's queries and the layer's keys (``snapkv.hooks.eager_attention_weights``): the
layer's attention runs as sdpa, and one ``[b, H, L, L]`` tensor lives while that layer is compressed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import softmax_bytes
from ..registry import register
from ..prompt_scores import WholePromptMethod, by_real_rows
from ..select import aggregate_heads


def observed_scores(weights: torch.Tensor, num_kv_heads: int, gqa: str = "mean") -> torch.Tensor:
    """``[b, kv_heads, n]`` from the attention weights ``[b, H, q, n]`` of the last ``q`` of ``n`` positions
    (``q = n`` at a prefill): each key's summed weight over the queries that can see it (``min(q, n - j)``),
    reduced over each KV group (kvpress: the mean)."""
    n, q_len = weights.shape[-1], weights.shape[-2]
    seen_by = torch.arange(n, 0, -1).clamp(max=q_len).to(weights.device, weights.dtype)
    return aggregate_heads(weights.sum(2) / seen_by, num_kv_heads, gqa)


@register
@dataclass
class ObservedAttention(WholePromptMethod):
    method = "observed_attention"
    display_name = "ObservedAttention"
    kvpress_entries = {"observed_attention": {}}
    paper = "kvpress's observed attention (after H2O, arXiv 2306.14048)"
    reference = ("kvpress 0.5.5 `ObservedAttentionPress` (the prefill's attention weights averaged over the queries "
                 "seeing each key, then over each KV group)")
    budget_meaning = "tokens per KV head, no window"
    deviations = ("with sdpa the weights are computed again from the sdpa model's queries and keys (kvpress runs "
                  "the whole model eagerly)")
    scores_positions = True
    needs_attention_weights = True
    untagged = ()  # gqa: the mean over each group (kvpress's), or max
    tag_parts = ("{gqa}",)

    def score(self, ctx):
        weights = ctx.attention_weights()  # [b, H, q, L]
        offset = ctx.keys.shape[-2] - weights.shape[-2]  # keys before this pass's queries (a later turn)

        def rows(selected, first):  # a padded row: its real queries over its real keys
            return observed_scores(weights[selected, :, max(0, first - offset):, first:], ctx.keys.shape[1],
                                   self.gqa)
        return by_real_rows(ctx.pad_mask, rows)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """Beside sdpa: every query (the module's own projection, kept), the keys repeated to every query head,
        the ``[b, H, L, L]`` weights in the model dtype, one block of rows' scores and float32 softmax, and the
        summed scores (with eager attention the weights are the module's, already planned)."""
        queries = batch * shape.heads * length * shape.head_dim * nbytes
        repeated = batch * shape.heads * length * shape.head_dim * nbytes
        weights = batch * shape.heads * length * length * nbytes
        rows = min(length, 128 if shape.device.startswith("cpu") else 1024)
        block = batch * shape.heads * rows * length * softmax_bytes(nbytes)
        return queries + repeated + weights + block + 2 * batch * shape.heads * length * 4
