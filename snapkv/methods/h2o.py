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
    """Causal attention summed over every query: ``[b, H, L]`` (the model dtype, or float32)."""
    b, n_heads, length, d = queries.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    dtype = queries.dtype if accumulate == "model" else torch.float32
    k = keys.unsqueeze(2).transpose(-1, -2)
    total = torch.zeros(b, n_kv, group, length, dtype=dtype, device=queries.device)
    key_pos = torch.arange(length, device=queries.device)
    for start in range(0, length, _QUERY_CHUNK):
        q = queries[:, :, start:start + _QUERY_CHUNK].reshape(b, n_kv, group, -1, d)
        # in place: one chunk of scores is query_chunk x L per head, the largest tensor H2O makes
        scores = scale_scores(torch.matmul(q, k), d, scaling, inplace=True)
        query_pos = key_pos[start:start + q.shape[-2]]
        blocked = key_pos[None, :] > query_pos[:, None]
        if pad_mask is not None:
            blocked = blocked | ~pad_mask[:, None, None, None, :]
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype).to(dtype)
        if pad_mask is not None:
            probs = probs * pad_mask[:, None, None, start:start + q.shape[-2], None]
        total += probs.sum(dim=-2)
        del scores, probs  # before the next chunk's scores exist, not after
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
