"""Expected Attention (Devoto et al., kvpress, arXiv 2510.00636, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"): each position is scored by the
attention that future queries are expected to pay it.

As kvpress 0.5.5 ``ExpectedAttentionPress`` scores it, with its defaults: the mean and covariance of the
prompt's pre-RoPE queries (the first ``n_sink`` rows left out), rotated by RoPE averaged over the next
``n_future_positions`` positions; per query head ``softmax(K mu / sqrt(d) + K Sigma K^T / 2d)``, averaged
over each KV group, times the value's L2 norm (plus ``epsilon``); the first ``n_sink`` positions are
always kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..architectures import layer_rotary, prerope_queries, reading, rotation_matrices
from ..errors import InputError, check_bool, check_int, check_number
from ..registry import register
from ..prompt_scores import WholePromptMethod, always_kept, by_real_rows


def averaged_rope(attn, rotary, like: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``[d, d]``: the layer's RoPE rotation ``R`` averaged over positions ``[start, start + count)``, as the module
    rotates (``snapkv.architectures.rotation_matrices``: partial, interleaved, none on a layer without RoPE)."""
    positions = torch.arange(start, start + count, device=like.device)[None]
    cos, sin = layer_rotary(rotary, attn, like, positions)
    return rotation_matrices(attn, cos[0], sin[0]).contiguous().mean(dim=0)


@register
@dataclass
class ExpectedAttention(WholePromptMethod):
    method = "expected_attention"
    display_name = "ExpectedAttention"
    kvpress_entries = {"ExpectedAttentionPress": {}}  # the bare press: no registry entry of its own
    paper = "Expected Attention, arXiv 2510.00636"
    reference = ("kvpress 0.5.5 `ExpectedAttentionPress` with its defaults (512 future positions, 4 sinks, "
                 "covariance, value norms, epsilon 0)")
    budget_meaning = "tokens per KV head, the sinks included"
    deviations = "none (parity-tested)"
    scores_positions = True
    tag_parts = ("f{n_future_positions}", "s{n_sink}", "cov{use_covariance}", "vn{use_vnorm}", "e{epsilon}")
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def validate(self) -> None:
        super().validate()
        check_int("n_future_positions", self.n_future_positions, 1)
        check_int("n_sink", self.n_sink, 0)
        check_bool("use_covariance", self.use_covariance)
        check_bool("use_vnorm", self.use_vnorm)
        self.epsilon = check_number("epsilon", self.epsilon, 0)

    def check_decoding(self) -> None:
        super().check_decoding()
        buffered = min(self.decode_interval, self.decode_buffer + 1) if self.decodes else None
        if buffered is not None and buffered <= self.n_sink:  # the decoded tokens a cut reads at most
            raise InputError(f"decode_interval={self.decode_interval}, decode_buffer={self.decode_buffer}: a cut while "
                             f"decoding reads {buffered} buffered tokens, and expected_attention reads the queries "
                             f"after the first n_sink={self.n_sink}; raise both above n_sink")

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # kvpress needs more tokens than sinks; a prompt of no more is kept whole
        return length if length <= self.n_sink else self.budget_for(length)

    def score(self, ctx):
        if ctx.rotary is None:
            raise InputError("expected_attention: the model has no rotary embedding (model.model.rotary_emb)")
        return by_real_rows(ctx.pad_mask, lambda rows, first: self._scores(
            ctx, ctx.hidden_states[rows, first:], ctx.keys[rows, :, first:], ctx.values[rows, :, first:]))

    def _query_statistics(self, ctx, hidden: torch.Tensor):
        attn = ctx.attn
        queries = prerope_queries(attn, hidden[:, self.n_sink:])
        mean = queries.mean(dim=2, keepdim=True)
        covariance = None
        if self.use_covariance:
            centered = queries - mean
            covariance = torch.einsum("bnsi,bnsj->bnij", centered, centered) / queries.shape[2]
        mean = mean.squeeze(2)
        rotation = averaged_rope(attn, ctx.rotary, mean, hidden.shape[1], self.n_future_positions)
        mean = torch.matmul(mean, rotation.T)
        if covariance is not None:
            covariance = torch.matmul(rotation, torch.matmul(covariance, rotation.T))
        return mean, covariance

    def _scores(self, ctx, hidden, keys, values):
        keys, values = keys[:, :, self.n_sink:], values[:, :, self.n_sink:]
        mean, covariance = self._query_statistics(ctx, hidden)
        b, n_kv, n, d = keys.shape
        groups = reading(ctx.attn).query_heads // n_kv
        keys = keys.repeat_interleave(groups, dim=1).transpose(2, 3)
        scores = torch.matmul(mean.unsqueeze(2), keys).squeeze(2) / math.sqrt(d)
        if covariance is not None:
            scores += torch.einsum("bhin, bhij, bhjn->bhn", keys, covariance, keys) / d / 2
        scores = F.softmax(scores, dim=-1).view(b, n_kv, groups, n).mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        return always_kept(scores, first=self.n_sink)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The layer's pre-RoPE queries and their centred copy, the keys repeated to every query head
        and the covariance term's product of the same size, the rotations averaged, the scores."""
        per_head_rows = batch * shape.heads * length * shape.head_dim * nbytes
        rotations = self.n_future_positions * shape.head_dim ** 2 * 4 * 2
        return 4 * per_head_rows + rotations + batch * shape.heads * length * 4 * 3
