"""Pure tensor scoring and selection: the SnapKV observation-window vote.

Every step mirrors the official ``SnapKVCluster.update_kv`` (FasterDecoding/SnapKV): scaled dot
product in the input dtype, a causal mask inside the window, softmax over all keys in float32 cast
back to the input dtype, sum over the window queries, 1-D pooling (padding ``kernel // 2``,
stride 1), top-k. The window x L scores are computed a few KV heads at a time, so no L x L matrix
and no repeated copy of the keys is ever built.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .architectures import AttentionForm
from .errors import InputError

# Bytes of window x L float32 attention one chunk of heads may hold at once.
_CHUNK_BYTES = 256 * 2**20


def _kv_head_chunk(batch: int, group: int, window: int, length: int) -> int:
    per_kv_head = batch * group * window * length * 4
    return max(1, _CHUNK_BYTES // max(per_kv_head, 1))


def scale_scores(scores: torch.Tensor, head_dim: int, scaling: float | None, inplace: bool = False) -> torch.Tensor:
    """Q K^T scaled as the attention module does (``attn.scaling``); None: the official
    ``/ sqrt(head_dim)``, the same value for every supported model. ``inplace`` writes into
    ``scores`` (same values, no second copy of a large score tensor)."""
    if scaling is None:
        return scores.div_(math.sqrt(head_dim)) if inplace else scores / math.sqrt(head_dim)
    return scores.mul_(scaling) if inplace else scores * scaling


def as_form(scaling) -> AttentionForm:
    """A layer's ``AttentionForm``, or a bare scaling (float or None: ``1/sqrt(d)``) as the plain form."""
    return scaling if isinstance(scaling, AttentionForm) else AttentionForm(scaling)


def model_logits(scores: torch.Tensor, head_dim: int, form: AttentionForm) -> torch.Tensor:
    """``Q K^T`` to the logits the module's attention takes, in place: its scaling, then its tanh soft-capping
    (Gemma 2: ``softcap * tanh(s / softcap)``) where it has one."""
    scale_scores(scores, head_dim, form.scaling, inplace=True)
    if form.softcap is not None:
        scores.div_(form.softcap).tanh_().mul_(form.softcap)
    return scores


def attention_softmax(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 softmax over the last dimension; ``sinks`` (broadcast to ``logits[..., :1]``): a logit per head
    that joins each row's denominator and is dropped after (gpt-oss's attention sinks, as its eager attention
    computes them: the row's maximum subtracted first)."""
    if sinks is None:
        return F.softmax(logits, dim=-1, dtype=torch.float32)
    combined = torch.cat([logits, sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return F.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]


def outside_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None):
    """``[q, L]`` True where a key is older than a sliding window of ``window`` lets the query see (None: none)."""
    if window is None:
        return None
    return key_positions[None, :] <= query_positions[:, None] - window


def window_attention(queries: torch.Tensor, keys: torch.Tensor, window: int,
                     pad_mask: torch.Tensor | None = None, scaling: float | None = None,
                     reduce: str = "sum") -> torch.Tensor:
    """Attention of the last ``window`` queries summed over those queries (``reduce="mean"``: their
    mean, as kvpress's ``SnapKVPress`` takes it; ``"both"``: the pair ``(sum, mean)`` of one pass).

    queries ``[b, H, Lq, d]``, keys ``[b, Hkv, L, d]``; returns ``[b, H, L - window]`` in the input
    dtype (query head ``h`` reads KV head ``h // (H / Hkv)``, as ``repeat_kv`` does).
    ``pad_mask`` ``[b, L]`` (True = real token) masks padded keys out of the softmax. ``scaling``
    is the layer's ``AttentionForm`` (its module's scaling, soft-capping, sinks and sliding window, as it
    attends) or a bare scaling; None: the official code's ``1/sqrt(head_dim)``.
    """
    b, n_heads, _, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv
    form = as_form(scaling)
    q = queries[:, :, -window:, :].reshape(b, n_kv, group, window, d)
    dtype_min = torch.finfo(queries.dtype).min
    causal = torch.full((window, window), dtype_min, dtype=queries.dtype, device=queries.device)
    causal = torch.triu(causal, diagonal=1)
    positions = torch.arange(length, device=queries.device)
    older = outside_window(positions[-window:], positions, form.sliding_window)
    sinks = None if form.sinks is None else form.sinks.view(n_kv, group, 1, 1)
    sums, means = [], []
    step = _kv_head_chunk(b, group, window, length)
    for start in range(0, n_kv, step):
        part = q[:, start:start + step]
        heads = part.shape[1]
        # each KV head's group of query rows against its keys: one batched product, the keys read where they are
        scores = torch.matmul(part.reshape(b, heads, group * window, d), keys[:, start:start + step].transpose(-1, -2))
        scores = model_logits(scores.view(b, heads, group, window, length), d, form)
        scores[..., -window:] += causal
        if older is not None:
            scores.masked_fill_(older, dtype_min)
        if pad_mask is not None:
            scores = scores.masked_fill(~pad_mask[:, None, None, None, :], dtype_min)
        probs = attention_softmax(scores, None if sinks is None else sinks[start:start + step]).to(queries.dtype)
        del scores
        # each position's column reduced over the window's queries, then the window's own columns dropped (a
        # reduction of the slice would copy it first)
        if reduce != "mean":
            sums.append(probs.sum(dim=-2)[..., :-window])
        if reduce != "sum":
            means.append(probs.mean(dim=-2)[..., :-window])
        del probs
    out = [torch.cat(part, dim=1).reshape(b, n_heads, length - window) for part in (sums, means) if part]
    return tuple(out) if reduce == "both" else out[0]


def pool(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    """Smooth ``[b, h, n]`` scores along positions (the paper's clustering step)."""
    if pooling == "none" or kernel == 1:
        return scores
    b, h, n = scores.shape
    flat = scores.reshape(b * h, 1, n)
    if pooling == "maxpool":
        flat = F.max_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    else:
        flat = F.avg_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    return flat.reshape(b, h, n)


def aggregate_heads(scores: torch.Tensor, num_kv_heads: int, gqa: str) -> torch.Tensor:
    """Per-query-head scores ``[b, H, n]`` to the heads the cache keeps.

    ``repeat`` keeps one selection per query head (the official code, which repeats KV to every
    query head); ``mean``/``max`` combine each KV group's query heads into one selection.
    """
    if gqa == "repeat" or scores.shape[1] == num_kv_heads:
        return scores
    b, h, n = scores.shape
    grouped = scores.reshape(b, num_kv_heads, h // num_kv_heads, n)
    return grouped.mean(dim=2) if gqa == "mean" else grouped.amax(dim=2)


def top_positions(scores: torch.Tensor, k: int, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` best positions per head, sorted ascending.

    Uses ``torch.topk`` as the official code does. With left padding each row is ranked on its
    unpadded slice, so a row's choice (ties included) is the one it gets unbatched; a row with
    fewer than ``k`` real candidates keeps all of them and fills up with padded slots.
    """
    if pad_mask is None:
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values
    n = scores.shape[-1]
    pads = (~pad_mask).sum(dim=1)
    if not torch.equal(pad_mask, torch.arange(pad_mask.shape[1], device=pad_mask.device)[None, :] >= pads[:, None]):
        raise InputError("attention_mask: only left padding is supported (zeros before the tokens of each row)")
    rows = []
    for row, p in enumerate(pads.tolist()):
        real = n - p
        if real >= k:
            picked = scores[row, :, p:].contiguous().topk(k, dim=-1).indices.sort(dim=-1).values + p
        else:
            picked = torch.arange(n - k, n, device=scores.device)[None, :].expand(scores.shape[1], k)
        rows.append(picked)
    return torch.stack(rows)


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, cfg,
                  pad_mask: torch.Tensor | None = None, scaling: float | None = None) -> torch.Tensor:
    """The pooled observation-window vote for positions ``[0, L - window)``."""
    votes = window_attention(queries, keys, cfg.window, pad_mask, scaling)
    votes = pool(votes, cfg.pooling, cfg.kernel)
    return aggregate_heads(votes, keys.shape[1], cfg.gqa)


def select_positions(queries: torch.Tensor, keys: torch.Tensor, cfg,
                     pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Kept earlier positions ``[b, heads, budget - window]`` (the official selection), sorted ascending."""
    length = keys.shape[-2]
    budget = cfg.budget_for(length)  # the fixed budget, or the prompt's share with compressor.ratio
    if length < budget:
        raise InputError(f"budget={budget} is larger than the sequence length {length}")
    if queries.shape[-2] < cfg.window:
        raise InputError(f"queries hold {queries.shape[-2]} rows, fewer than window={cfg.window}")
    return top_positions(snapkv_scores(queries, keys, cfg, pad_mask), budget - cfg.window, pad_mask)


def always_kept(scores: torch.Tensor, first: int = 0, last: int = 0) -> torch.Tensor:
    """``scores`` with ``first`` positions before and ``last`` after them that outrank every other
    position (kvpress's ``F.pad(scores, ..., value=scores.max().item() + 1)``)."""
    if not first and not last:
        return scores
    return F.pad(scores, (first, last), value=scores.max().item() + 1)


def pack(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep`` ``[b, heads, n]`` to ``(kept, valid)`` ``[b, heads, longest]``: each head's kept positions
    ascending, then (``valid`` False) positions it did not keep (the cache stores the valid ones only,
    ``snapkv.ragged.pack_heads``)."""
    counts = keep.sum(dim=-1)
    longest = int(counts.max())
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :longest]
    valid = torch.arange(longest, device=keep.device) < counts[..., None]
    return order, valid
