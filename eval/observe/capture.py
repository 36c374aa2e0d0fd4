"""One forward pass over prompt + response with a hook on every attention module that turns that
layer's attention into hit rates right away: only the rows of the windows involved are computed
(rows x L, a few KV heads at a time), never an L x L matrix, and nothing of a layer is kept."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from snapkv.architectures import attention_of, check_supported, decoder_layers, queries_at
from snapkv.transformers_workarounds import cache_argument
from snapkv.select import scale_scores

from .hits import counted_hit_rates, important_counts

_CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Windows:
    """The paper's windows. Figure 2: the prompt's last ``prompt_windows`` windows, each voting over
    the positions before it, against the response's attention. Figure 3: the last prompt window
    against each of ``response_windows`` windows of the response."""
    prompt_len: int
    size: int
    prompt_windows: int
    response_windows: int

    @property
    def first_row(self) -> int:
        return self.prompt_len - self.prompt_windows * self.size

    def prompt_window(self, i: int) -> tuple[int, int]:
        start = self.prompt_len - (self.prompt_windows - i) * self.size
        return start, start + self.size

    def response_window(self, j: int) -> tuple[int, int]:
        start = self.prompt_len + j * self.size
        return start, start + self.size

    @property
    def end(self) -> int:
        return self.prompt_len + self.response_windows * self.size


def row_attention(attn, queries: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor):
    """Yield ``(head_slice, probs)``: float32 causal attention ``[h, n, L]`` of query rows at
    positions ``rows`` over all keys, a few KV heads at a time (batch 1)."""
    _, n_heads, n, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv
    blocked = torch.arange(length, device=keys.device)[None, :] > rows[:, None]
    step = max(1, _CHUNK_BYTES // max(group * n * length * 4, 1))
    for start in range(0, n_kv, step):
        k = keys[0, start:start + step]                                   # [c, L, d]
        q = queries[0, start * group:(start + k.shape[0]) * group].reshape(k.shape[0], group, n, d)
        scores = scale_scores(torch.matmul(q, k[:, None].transpose(-1, -2)), d, getattr(attn, "scaling", None),
                              inplace=True)
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        yield slice(start * group, (start + k.shape[0]) * group), probs.reshape(-1, n, length)


def layer_records(attn, hidden, position_embeddings, keys, w: Windows, p: float, theta: float,
                  pooling: str, kernel: int) -> list[dict]:
    rows = torch.arange(w.first_row, w.end, device=keys.device)
    queries = queries_at(attn, hidden, position_embeddings, slice(w.first_row, w.end))
    n_heads = queries.shape[1]
    out = {}  # (figure, window) -> per-head hit rates
    obs_start, obs_end = w.prompt_window(w.prompt_windows - 1)
    for heads, probs in row_attention(attn, queries, rows, keys[:, :, :w.end]):
        local = lambda a, b: slice(a - w.first_row, b - w.first_row)  # noqa: E731
        response = important_counts(probs[:, local(w.prompt_len, w.end)], theta)
        for i in range(w.prompt_windows):
            a, b = w.prompt_window(i)
            if a < 1:
                continue
            votes = probs[:, local(a, b), :a].sum(dim=1)
            rate, _ = counted_hit_rates(response[:, :a], votes, p, pooling, kernel)
            out.setdefault((2, i), torch.full((n_heads,), float("nan")))[heads] = rate.cpu()
        votes = probs[:, local(obs_start, obs_end), :obs_start].sum(dim=1)
        for j in range(w.response_windows):
            a, b = w.response_window(j)
            counts = important_counts(probs[:, local(a, b), :obs_start], theta)
            rate, _ = counted_hit_rates(counts, votes, p, pooling, kernel)
            out.setdefault((3, j), torch.full((n_heads,), float("nan")))[heads] = rate.cpu()
    return [{"figure": fig, "layer": attn.layer_idx, "window": win,
             "heads": [None if math.isnan(v) else round(float(v), 5) for v in rates]}
            for (fig, win), rates in sorted(out.items())]


def _run_with_hook(model, ids: torch.Tensor, on_layer) -> None:
    from transformers import DynamicCache
    check_supported(model)
    handles = []

    def hook(module, args, kwargs, output):
        layer = cache_argument(kwargs).layers[module.layer_idx]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        with torch.no_grad():
            on_layer(module, hidden, kwargs["position_embeddings"], layer.keys)

    for layer in decoder_layers(model):
        handles.append(attention_of(layer).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.inference_mode():
            model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()


def hit_rate_pass(model, ids: torch.Tensor, w: Windows, p: float, theta: float, pooling: str = "none",
                  kernel: int = 1) -> list[dict]:
    """Hit-rate records of every layer for one teacher-forced sequence ``ids`` ``[1, >= w.end]``."""
    records: list[dict] = []
    _run_with_hook(model, ids[:, :w.end], lambda attn, hidden, pos, keys: records.extend(
        layer_records(attn, hidden, pos, keys, w, p, theta, pooling, kernel)))
    return records


def last_window_votes(model, ids: torch.Tensor, size: int, prefix: int) -> dict[int, torch.Tensor]:
    """Per layer, the last ``size`` prompt rows' summed attention over the first ``prefix`` positions."""
    votes: dict[int, torch.Tensor] = {}
    length = ids.shape[1]

    def on_layer(attn, hidden, pos, keys):
        rows = torch.arange(length - size, length, device=keys.device)
        queries = queries_at(attn, hidden, pos, slice(length - size, length))
        parts = [probs[:, :, :prefix].sum(dim=1) for _, probs in row_attention(attn, queries, rows, keys)]
        votes[attn.layer_idx] = torch.cat(parts).cpu()

    _run_with_hook(model, ids, on_layer)
    return votes
