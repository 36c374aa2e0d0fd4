"""H2O (Zhang et al., arXiv 2306.14048, "Heavy-Hitter Oracle"), one-shot prefill variant: heavy
hitters plus a recent window.

As SnapKV's Table 1 ran it, through KVCache-Factory ``pyramidkv/pyramidkv_utils.py``
(``H2OKVCluster.update_kv``): at prefill every prompt query's causal attention (softmax in float32,
cast back to the model dtype) is summed per key in the model dtype; the ``budget - window`` keys with
the largest total among the earlier positions are kept with the last ``window`` tokens; no pooling,
and no further eviction while decoding (the original H2O evicts at every step). The SnapKV paper
does not state H2O's window: 32 here, as its SnapKV settings; KVCache-Factory's ``run_longbench.py``
uses 8 (``compressor.window=8``).
``accumulate="float32"`` sums in float32 instead (a deliberate deviation, more exact in half
precision). The L x L attention is never held: queries are processed in chunks and only the column
sums are kept, added in float32 and rounded to the model dtype once (the official one-shot sum
rounds once too; the two can differ in the order of the float32 additions only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import check_choice
from ..method import Method
from ..registry import register
from ..select import aggregate_heads, as_form, attention_softmax, model_logits, outside_window

# Query rows per chunk, by device. On a CPU a chunk's scores and probabilities (a KV head's query
# heads x 128 rows x L) stay in cache between the matmul, the softmax and the column sum: SmolLM2 at
# 6.8K tokens, one layer on a 2-core CPU, 0.30 s in chunks of 128 rows, 0.48-0.51 s in chunks of
# 1,024 (the same sums). On a GPU every chunk and head is a handful of kernel launches, so chunks stay
# large (LWM-7B at 32K tokens: 32 chunks x 32 KV heads a layer at 1,024 rows, 256 x 32 at 128).
_QUERY_CHUNK = 1024
_CPU_QUERY_CHUNK = 128


def query_chunk(device) -> int:
    return _CPU_QUERY_CHUNK if str(device).startswith("cpu") else _QUERY_CHUNK
ACCUMULATE = ("model", "float32")


def accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, pad_mask: torch.Tensor | None = None,
                          accumulate: str = "model", scaling: float | None = None) -> torch.Tensor:
    """Causal attention summed over every query: ``[b, H, L]`` (the model dtype, or float32).

    Queries go in chunks of ``query_chunk(device)`` rows and one KV head (its group of query heads) at a
    time; a chunk is scored against the keys up to its last query only, since later keys get an
    exact zero from the causal softmax, and only its diagonal block needs the causal mask. Every
    chunk's scores and probabilities go into buffers allocated once (a fresh allocation of that
    size would be new, page-faulted memory at every chunk): one in float32, where the softmax is taken
    in place, and a float32 one for the probabilities beside the scores in a lower precision. The
    chunks' sums are added in float32 and rounded to the model dtype once, as the official one-shot
    sum is (they can differ from it in the order of the float32 additions only). The queries are the
    module's own projection of every position (``reads_every_query``: kept from its q_proj call)."""
    b, n_heads, length, d = queries.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    form = as_form(scaling)
    scale = form.scaling if form.scaling is not None else 1 / math.sqrt(d)
    # A power of two (1/8 for head_dim 64) scales every product and partial sum exactly, so the
    # queries are scaled before the matmul instead of the chunk's scores after it: the same bits.
    fold = math.frexp(scale)[0] == 0.5 and form.softcap is None
    sinks = None if form.sinks is None else form.sinks.view(n_kv, group, 1, 1)
    total = torch.zeros(b, n_kv, group, length, dtype=torch.float32, device=queries.device)
    chunk = query_chunk(queries.device)
    size = b * group * min(chunk, length) * length
    scores_buffer = torch.empty(size, dtype=queries.dtype, device=queries.device)
    # float32 scores take their softmax in place (the same values): one buffer stays in cache
    in_place = queries.dtype == torch.float32
    probs_buffer = scores_buffer if in_place else torch.empty(size, dtype=torch.float32, device=queries.device)
    key_pos = torch.arange(length, device=queries.device)
    lowest = torch.finfo(queries.dtype).min
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        rows = end - start
        diagonal = key_pos[None, start:end] > key_pos[start:end, None]
        older = outside_window(key_pos[start:end], key_pos[:end], form.sliding_window)
        for head in range(n_kv):
            q = queries[:, head * group:(head + 1) * group, start:end].reshape(b, group * rows, d)
            if fold:
                q = q * scale
            scores = scores_buffer[:b * group * rows * end].view(b, group * rows, end)
            torch.matmul(q, keys[:, head, :end].transpose(-1, -2), out=scores)
            scores = scores.view(b, group, rows, end)
            if not fold:
                model_logits(scores, d, form)
            scores[..., start:].masked_fill_(diagonal, lowest)
            if older is not None:
                scores.masked_fill_(older, lowest)
            if pad_mask is not None:
                scores.masked_fill_(~pad_mask[:, None, None, :end], lowest)
            probs = probs_buffer[:b * group * rows * end].view(b, group, rows, end)
            if sinks is None:
                torch.softmax(scores, dim=-1, dtype=torch.float32, out=probs)
            else:
                probs.copy_(attention_softmax(scores, sinks[head]))
            if queries.dtype != torch.float32:  # the official cast back to the model dtype
                probs = scores.copy_(probs)
            if pad_mask is not None:
                probs = probs * pad_mask[:, None, start:end, None]
            total[:, head, :, :end] += probs.sum(dim=-2, dtype=torch.float32)
    return total.reshape(b, n_heads, length).to(queries.dtype if accumulate == "model" else torch.float32)


@register
@dataclass
class H2O(Method):
    method = "h2o"
    display_name = "H2O"
    paper = "H2O, arXiv 2306.14048"
    reference = "KVCache-Factory `H2OKVCluster.update_kv` (one-shot at prefill; scores summed in the model dtype)"
    budget_meaning = "heavy hitters + window"
    deviations = ("no eviction while decoding (as KVCache-Factory); `accumulate=float32` optional; the window (32) is"
                  " our choice, KVCache-Factory's `run_longbench.py` uses 8")
    scores_positions = True
    tag_parts = ("w{window}", "{gqa}", "{accumulate}")
    budget: int = 4096
    window: int = 32
    gqa: str = "mean"
    accumulate: str = "model"
    reads_every_query = True

    def validate(self) -> None:
        super().validate()
        check_choice("accumulate", self.accumulate, ACCUMULATE)

    def score(self, ctx):
        keys = ctx.keys
        votes = ctx.shared(("accumulated_attention", self.accumulate), lambda: accumulated_attention(
            ctx.queries(keys.shape[-2]), keys, ctx.pad_mask, self.accumulate, ctx.form))
        return aggregate_heads(votes[..., :-self.window].float(), keys.shape[1], self.gqa)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """All L queries; the scores buffer (the model dtype) and, below float32, the float32
        probabilities buffer of one KV head's group of query heads and a chunk of rows against every
        key (the last chunk's size) and a float32 copy of the probabilities where they are summed in
        float32; the chunk's causal mask (bool, its diagonal block); the summed votes."""
        queries = batch * shape.heads * length * shape.head_dim * nbytes
        rows = min(length, query_chunk(shape.device))
        per_entry = nbytes + (4 + (4 if self.accumulate == "float32" else 0) if nbytes != 4 else 0)
        scores = batch * (shape.heads // shape.kv_heads) * rows * length * per_entry
        return queries + scores + rows * rows + batch * shape.heads * length * 4 * 2
