"""H2O (Zhang et al., arXiv 2306.14048, "Heavy-Hitter Oracle"), one-shot prefill variant: heavy
hitters plus a recent window.

As SnapKV's Table 1 ran it, through KVCache-Factory ``pyramidkv/pyramidkv_utils.py``
(``H2OKVCluster.update_kv``): at prefill every prompt query's causal attention (softmax in float32,
cast back to the model dtype) is summed per key in the model dtype; the ``budget - window`` keys with
the largest total among the earlier positions are kept with the last ``window`` tokens; no pooling,
and no further eviction while decoding (the original H2O evicts at every step).
``accumulate="float32"`` sums in float32 instead (a deliberate deviation, more exact in half
precision). The L x L attention is never held: queries are processed in chunks and only the column
sums are kept (the chunked sum in the model dtype can differ from the official one-shot sum in the
last bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import CompressorConfig, check_choice, register
from ..select import aggregate_heads, scale_scores

_QUERY_CHUNK = 1024
ACCUMULATE = ("model", "float32")


def accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, pad_mask: torch.Tensor | None = None,
                          accumulate: str = "model", scaling: float | None = None) -> torch.Tensor:
    """Causal attention summed over every query: ``[b, H, L]`` (the model dtype, or float32).

    Queries go in chunks of ``_QUERY_CHUNK`` rows and one KV head (its group of query heads) at a
    time; a chunk is scored against the keys up to its last query only, since later keys get an
    exact zero from the causal softmax. Both keep a chunk's scores small (query_chunk x prefix per
    query head of one group) and halve the work of scoring every key."""
    b, n_heads, length, d = queries.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    dtype = queries.dtype if accumulate == "model" else torch.float32
    total = torch.zeros(b, n_kv, group, length, dtype=dtype, device=queries.device)
    key_pos = torch.arange(length, device=queries.device)
    for start in range(0, length, _QUERY_CHUNK):
        end = min(start + _QUERY_CHUNK, length)
        blocked = key_pos[None, :end] > key_pos[start:end, None]
        if pad_mask is not None:
            blocked = blocked | ~pad_mask[:, None, None, :end]          # [b, 1, rows, end]
        for head in range(n_kv):
            q = queries[:, head * group:(head + 1) * group, start:end]  # [b, group, rows, d]
            k = keys[:, head:head + 1, :end]
            # in place: the chunk's scores are the largest tensor H2O makes
            scores = scale_scores(torch.matmul(q, k.transpose(-1, -2)), d, scaling, inplace=True)
            scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype).to(dtype)
            del scores
            if pad_mask is not None:
                probs = probs * pad_mask[:, None, start:end, None]
            total[:, head, :, :end] += probs.sum(dim=-2)
            del probs  # before the next head's scores exist, not after
    return total.reshape(b, n_heads, length)


@register
@dataclass
class H2OConfig(CompressorConfig):
    method = "h2o"
    display_name = "H2O"
    budget: int = 4096
    window: int = 32
    gqa: str = "mean"
    accumulate: str = "model"

    def validate(self) -> None:
        super().validate()
        check_choice("accumulate", self.accumulate, ACCUMULATE)

    def score(self, ctx):
        keys = ctx.keys
        votes = ctx.shared(("accumulated_attention", self.accumulate), lambda: accumulated_attention(
            ctx.queries(keys.shape[-2]), keys, ctx.pad_mask, self.accumulate, ctx.scaling))
        return aggregate_heads(votes[..., :-self.window].float(), keys.shape[1], self.gqa)
