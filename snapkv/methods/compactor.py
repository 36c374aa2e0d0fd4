"""Compactor (Chari & Van Durme, arXiv 2507.08143, "Compactor: Calibrated Query-Agnostic KV Cache
Compression with Approximate Leverage Scores"): a position matters as much as its key is a geometric
outlier (approximate leverage) and as much attention the prompt's own queries pay it, non-causally.

As kvpress 0.5.5 ``CompactorPress`` scores it, with its defaults (8 first and 4 last positions always
kept, chunks of 256, a sketch of 48, ``blending`` = the compression ratio): on the positions between the
sinks, (1) ``LeverageScorePress``: the pre-RoPE keys (``k_proj`` of exactly those rows), centred over the
sequence, times a Gaussian sketch ``[head_dim, 48] / sqrt(48)`` drawn per KV head, in float32; their
leverage ``diag(X (X^T X)^-1 X^T)`` through a Cholesky factor (jitter 1e-2, tenfold on failure), z-scored
over every head; (2) ``NonCausalAttnPress``: the RoPE'd queries of those rows against the keys in chunks
of ``chunk_size`` without a causal mask nor scaling (the last chunk zero-padded, its padded queries 0 and
padded keys -1e-9 before a float32 softmax), the attention each key gets summed over the chunk's queries,
averaged over each KV group, times the value's L2 norm, average-pooled over 3 positions, z-scored;
``blending * leverage + attention``, and the sinks padded with the maximum. ``AdaKV(scorer=compactor)`` is
kvpress's ``adakv_compactor`` entry (``AdaKVPress(CompactorPress())``).

kvpress draws the sketch from torch's global generator (unseeded: its choices vary from run to run); here
it is drawn from a generator seeded by ``seed`` and the layer's index, on the keys' device and in their
dtype, each batch row its own draw as it gets unbatched (kvpress: one draw of the batch's shape, and
z-scores over the whole batch). Seeding kvpress's global generator with that number right before each
layer's press call gives the same sketch (its parity fixture does). ``blending=None`` is the ratio (AdaKV
gives its scorer its own ratio, as kvpress's ``AdaKVPress`` does); with a budget (no ratio) it is kvpress's
own fallback 0.35. A prompt with fewer than two positions between the sinks is kept whole (its z-scores are
undefined).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..architectures import prerope_keys, prerope_queries, rotated
from ..errors import check_int, check_number
from ..memory import votes_bytes
from ..prompt_scores import WholePromptMethod, by_real_rows
from ..registry import register
from ..wrapping import rounding_spread

FALLBACK_BLENDING = 0.35  # kvpress's, where it has no compression ratio


def zscored(scores: torch.Tensor) -> torch.Tensor:
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


def cholesky_with_jitter(gram: torch.Tensor, jitter: float = 1e-2, tries: int = 5) -> torch.Tensor:
    """kvpress's ``chol_with_jitter``: ``gram + jitter I``, the jitter tenfold after each failure."""
    identity = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    current = float(jitter)
    for _ in range(tries):
        factor, info = torch.linalg.cholesky_ex(gram + current * identity, upper=False)
        if bool((info == 0).all()):
            return factor
        current = max(1e-8, 1e-2 if current == 0.0 else 10.0 * current)
    raise RuntimeError(f"compactor: the Cholesky factorization failed after {tries} tries")


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Approximate leverage ``[b, h, n]`` of pre-RoPE ``keys`` ``[b, h, n, d]`` through ``sketch``
    ``[b, h, d, k]``, z-scored (kvpress's ``LeverageScorePress``)."""
    x = torch.matmul(keys - keys.mean(dim=-2, keepdim=True), sketch).to(torch.float32)
    xt = x.transpose(-2, -1)
    gram = xt @ x
    factor = cholesky_with_jitter(0.5 * (gram + gram.transpose(-2, -1)))
    solved = torch.cholesky_solve(xt, factor, upper=False)
    return zscored((x * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0))


def non_causal_chunked_attention(q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[b, H, n]``: the attention each key gets from the queries of its chunk, summed (kvpress's
    ``NonCausalAttnPress.non_causal_chunked_attn``, its padding and masks included)."""
    b, h, n, d = k.shape
    padded_length = math.ceil(n / chunk) * chunk
    pad = padded_length - n
    if pad > 0:
        q = torch.cat([q, torch.zeros(b, h, pad, d, device=q.device, dtype=q.dtype)], dim=2)
        k = torch.cat([k, torch.zeros(b, h, pad, d, device=k.device, dtype=k.dtype)], dim=2)
        last_start = (n // chunk) * chunk
    else:
        last_start = ((n - 1) // chunk) * chunk
    invalid = (torch.arange(last_start, padded_length, device=q.device) >= n).view(1, 1, chunk).expand(b, h, chunk)
    chunks = padded_length // chunk
    dots = torch.matmul(q.view(b, h, chunks, chunk, d), k.view(b, h, chunks, chunk, d).transpose(-2, -1))
    dots[:, :, -1].masked_fill_(invalid.unsqueeze(-1), 0)
    dots[:, :, -1].masked_fill_(invalid.unsqueeze(-2), -1e-9)
    attention = torch.softmax(dots.to(torch.float32), dim=-1)
    return attention.sum(dim=-2).view(b, h, padded_length)[..., :n]


@register
@dataclass
class Compactor(WholePromptMethod):
    method = "compactor"
    display_name = "Compactor"
    kvpress_entries = {"compactor": {"parity": "kept positions and tokens equal (tested; kvpress's sketch seeded as "
                                               "ours)"},
                       # kvpress's "adakv_compactor" entry: AdaKVPress(CompactorPress())
                       "adakv_compactor": {"method": "adakv", "scorer": "compactor", "option": "adakv_compactor",
                                           "parity": "kept positions and tokens equal (tested; the sketch seeded "
                                                     "as ours)"}}
    paper = "Compactor, arXiv 2507.08143"
    reference = ("kvpress 0.5.5 `CompactorPress` with its defaults (8 + 4 sinks, chunks of 256, sketch 48, "
                 "blending = the ratio)")
    budget_meaning = "tokens per KV head, the sinks included"
    deviations = ("the sketch from a seeded generator, one per batch row (kvpress: torch's global one, one per "
                  "batch); with a budget (no ratio), `blending` 0.35, kvpress's own fallback")
    scores_positions = True
    tag_parts = ("s{sink_size_start}-{sink_size_end}", "c{chunk_size}", "sk{sketch_dimension}", "b{blending}",
                 "seed{seed}")
    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        check_int("sink_size_start", self.sink_size_start, 0)
        check_int("sink_size_end", self.sink_size_end, 0)
        check_int("chunk_size", self.chunk_size, 1)
        check_int("sketch_dimension", self.sketch_dimension, 1)
        if self.blending is not None:
            self.blending = check_number("blending", self.blending, 0, None, "the leverage scores' weight")
        check_int("seed", self.seed, 0)

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        # fewer than two positions between the sinks: nothing to z-score, the layer is kept whole
        return length if length < self.sink_size_start + self.sink_size_end + 2 else self.budget_for(length)

    def blend(self) -> float:
        """The leverage scores' weight: ``blending``, else the ratio, else kvpress's fallback 0.35."""
        if self.blending is not None:
            return self.blending
        return self.ratio if self.ratio is not None else FALLBACK_BLENDING

    def score(self, ctx):
        pad_mask = ctx.pad_mask
        if pad_mask is None:  # each row on its own, as it is unbatched (its own sketch and z-scores)
            pad_mask = torch.ones(ctx.keys.shape[0], ctx.keys.shape[-2], dtype=torch.bool, device=ctx.keys.device)
        cos, sin = ctx.position_embeddings
        return by_real_rows(pad_mask, lambda rows, first: self._scores(
            ctx, ctx.hidden_states[rows, first:], ctx.keys[rows, :, first:], ctx.values[rows, :, first:],
            cos[rows, first:], sin[rows, first:]))

    def _scores(self, ctx, hidden, keys, values, cos, sin):
        n = hidden.shape[1]
        left = min(self.sink_size_start, n)
        right = min(self.sink_size_end, max(0, n - left))
        if n - left - right < 2:  # a padded batch's short row: every position alike
            return torch.ones(keys.shape[:-1], dtype=torch.float32, device=keys.device)
        end = n - right
        hidden, keys, values = hidden[:, left:end], keys[:, :, left:end], values[:, :, left:end]
        cos, sin = cos[:, left:end], sin[:, left:end]
        attn = ctx.attn

        pre_keys = prerope_keys(attn, hidden)
        generator = torch.Generator(device=pre_keys.device).manual_seed(self.seed * 100_003 + ctx.layer_idx)
        b, h, _, d = pre_keys.shape
        sketch = torch.randn(b, h, d, self.sketch_dimension, generator=generator, device=pre_keys.device,
                             dtype=pre_keys.dtype) * (1 / math.sqrt(self.sketch_dimension))
        leverage = leverage_scores(pre_keys, sketch)

        queries = rotated(attn, prerope_queries(attn, hidden), cos, sin)
        n_kv = values.shape[1]
        attention = non_causal_chunked_attention(
            queries, keys.repeat_interleave(queries.shape[1] // n_kv, dim=1), self.chunk_size)
        attention = attention.view(attention.shape[0], n_kv, -1, attention.shape[-1]).mean(dim=-2)
        attention = F.avg_pool1d(attention * values.norm(dim=-1), kernel_size=3, padding=1, stride=1)

        scores = self.blend() * leverage + zscored(attention)
        return F.pad(scores, (left, right), value=float(scores.max()))

    def ranking_bounds(self, ctx, scores, tolerance: float) -> tuple:
        """Sums of z-scores, one of a leverage through a float32 Cholesky solve: one rounding of the inputs moves
        them by far more than ``tolerance`` of their size (on SmolLM2 up to 1.2e-3 at layer 0, 1e-5 to 1.2e-4
        elsewhere), so the spread is measured per head (``snapkv.wrapping.rounding_spread``), at least the default's."""
        low, high = super().ranking_bounds(ctx, scores, tolerance)
        spread = rounding_spread(ctx, self.score).to(scores.dtype)
        return torch.minimum(low, scores - spread), torch.maximum(high, scores + spread)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The queries (pre-RoPE, rotated, padded) and the keys repeated to every query head; one chunked
        product of ``chunk_size`` per position and query head with its float32 softmax; the sketched keys
        in float32 (with their solve and product) and the pre-RoPE keys; a few scores per position."""
        padded = math.ceil(length / self.chunk_size) * self.chunk_size
        rows = batch * shape.heads * padded * shape.head_dim * nbytes
        attention = batch * shape.heads * padded * min(self.chunk_size, padded) * (nbytes + 4 + 4)
        sketch = batch * shape.kv_heads * length * (2 * shape.head_dim * nbytes + 3 * self.sketch_dimension * 4)
        return 5 * rows + attention + sketch + batch * shape.heads * length * 4 + 6 * votes_bytes(shape, length, batch)
