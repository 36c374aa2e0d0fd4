"""ChunkKV (Liu et al., arXiv 2502.00299, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference"): whole chunks of consecutive positions are kept, the chunks a scorer ranks
highest, so that kept tokens keep their neighbours.

As kvpress 0.5.5 ``ChunkKVPress(press=SnapKVPress(), chunk_length=20)`` runs it (its registry entry
``chunkkv``, on the query-aware board): the wrapped scorer (``scorer=``, kvpress's SnapKV by default: window
64, kernel 5, average pooling, the mean over each KV group) ranks every prompt position; a chunk's score is
the mean over its ``chunk_length`` positions of the scores summed over the KV heads (the prompt's last
``L % chunk_length`` positions are a chunk of their own); the top ``max(1, int(chunks * (1 - ratio)))``
chunks are kept, the same positions for every KV head. A prompt shorter than one chunk is compressed by
the scorer alone (each head its top ``int(L * (1 - ratio))``). The paper's layer-wise index reuse is not in
kvpress and not here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, check_int
from ..registry import register
from ..wrapping import WrapperMethod


@register
@dataclass
class ChunkKV(WrapperMethod):
    method = "chunkkv"
    display_name = "ChunkKV"
    kvpress_entries = {"chunkkv": {"placements": ("aware",)}}
    paper = "ChunkKV, arXiv 2502.00299"
    reference = ("kvpress 0.5.5 `ChunkKVPress(press=SnapKVPress(), chunk_length=20)` (window 64, kernel 5, average "
                 "pooling; `scorer=` any scoring method)")
    budget_meaning = ("whole chunks: `ratio` keeps `max(1, int(chunks x (1 - ratio)))` of them, `budget` "
                      "`max(1, budget // chunk_length)` (the prompt's last, shorter chunk among them counts its own "
                      "length); every KV head the same positions")
    deviations = ("each batch row chooses its own chunks (kvpress: every row the first row's); a prompt not longer "
                  "than the scorer's window is kept whole (kvpress refuses it); the kept count is recorded assuming "
                  "the last, shorter chunk is kept (it holds the scorer's window)")
    tag_parts = ("{scorer}", "w{window}", "k{kernel}", "{pooling}", "{gqa}", "se{scorer_epsilon}", "c{chunk_length}")
    scorer: str = "snapkv"        # kvpress's ChunkKVPress(press=SnapKVPress())
    chunk_length: int = 20

    def validate(self) -> None:
        self.check_scorer_fields()
        check_int("chunk_length", self.chunk_length, 1)
        if self.ratio is None and self.budget <= self.window:
            raise InputError(f"budget={self.budget} must be larger than window={self.window}")

    def budget_for(self, length: int) -> int:
        """``budget``, or kvpress's ``compute_n_kept`` (at least 1): what the scorer alone keeps of a prompt
        shorter than one chunk."""
        return self.budget if self.ratio is None else max(1, int(length * (1 - self.ratio)))

    def chunks_kept(self, chunks: int) -> int:
        """Chunks kept of a prompt of ``chunks`` (the last one possibly shorter)."""
        if self.ratio is not None:
            return max(1, int(chunks * (1 - self.ratio)))
        return max(1, self.budget // self.chunk_length)

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        """Tokens per head kept: a prompt not longer than the scorer's window is kept whole (kvpress's SnapKV
        refuses it), one shorter than a chunk as the scorer alone keeps it; else the kept chunks' tokens, the
        last, shorter chunk among them (it holds the scorer's window)."""
        if length <= self.scorer_window(layer_idx, num_layers, length):
            return length
        if length < self.chunk_length:
            return min(length, self.budget_for(length))
        complete, remaining = divmod(length, self.chunk_length)
        kept = self.chunks_kept(complete + (remaining > 0))
        if kept >= complete + (remaining > 0):
            return length
        return kept * self.chunk_length if not remaining else (kept - 1) * self.chunk_length + remaining

    def stored_tokens(self, layer_idx: int, num_layers: int, length: int, heads: int) -> int:
        """The most a head may keep (whole chunks only, where the last, shorter chunk is not chosen)."""
        budget = self.layer_budget(layer_idx, num_layers, length)
        if budget >= length or length < self.chunk_length:
            return min(length, budget)
        complete, remaining = divmod(length, self.chunk_length)
        return min(length, self.chunks_kept(complete + (remaining > 0)) * self.chunk_length)

    def row_keep(self, ctx) -> torch.Tensor:
        """``[1, kv_heads, n]`` bool: what each head keeps of one row's ``n`` real positions (``ctx``: that
        row's context), as ``ChunkKVPress.compress`` chooses it."""
        n = ctx.keys.shape[-2]
        keep = torch.zeros(1, ctx.keys.shape[1], n, dtype=torch.bool, device=ctx.keys.device)
        if self.layer_budget(ctx.layer_idx, ctx.num_layers, n) >= n:
            return keep.fill_(True)
        scores = self.scorer_config().prompt_scores(ctx)
        length = self.chunk_length
        complete, remaining = divmod(n, length)
        if complete == 0:  # kvpress hands the prompt to the scorer's own compression: each head its top-k
            return keep.scatter_(-1, scores.topk(self.budget_for(n), dim=-1).indices, True)
        chunk_scores = scores[..., :complete * length].sum(dim=1).view(-1, complete, length).mean(dim=-1)
        if remaining > 0:
            last = scores[..., -remaining:].sum(dim=1).mean(dim=-1, keepdim=True)
            chunk_scores = torch.cat([chunk_scores, last], dim=-1)
        top = chunk_scores.topk(self.chunks_kept(complete + (remaining > 0)), dim=-1).indices[0]
        for start in (top * length).tolist():
            keep[..., start:start + length] = True  # the last chunk ends at the prompt's end
        return keep

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scorer's term, then its scores summed over the heads, the chunks' scores and the kept mask
        with its ordering."""
        scorer = self.scorer_config().compression_bytes(shape, length, batch, nbytes)
        return scorer + batch * length * 4 * 2 + batch * shape.kv_heads * length * (1 + 8 + 1)
