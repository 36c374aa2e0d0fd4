"""ThinK (Xu et al., arXiv 2407.21018, "ThinK: Thinner Key Cache by Query-Driven Pruning"): each KV head drops
the key channels that matter least to the recent queries, and keeps every token.

As kvpress 0.5.5 ``ThinKPress`` scores the channels: the last ``window`` (32) queries of the prompt (post-RoPE,
projected again from their hidden states), their squared value averaged over the window, then over the query
heads of each KV group; times the keys' squared value averaged over the prompt; the lowest
``int(head_dim * key_channel_ratio)`` channels of each (row, KV head) are pruned (``topk`` of the lowest, as
kvpress). kvpress zeroes them in the prompt's keys and keeps the cache's shape; here the prompt's keys store
only the kept channels (``Method.stores_key_channels``, ``snapkv.channels``), and attention over them equals
attention over the zeroed keys. Keys of tokens appended later (decoded tokens, a later turn) keep every
channel, as in kvpress. No token is cut: ``budget`` and ``ratio`` do not apply (kvpress's ``evaluate.py`` sets
``key_channel_compression_ratio`` for this press, never its ``compression_ratio``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
import torch

from ..errors import InputError, check_choice, check_int
from ..method import Method
from ..registry import register


def channel_scores(ctx, window: int, gqa: str) -> torch.Tensor:
    """``[b, kv_heads, head_dim]``: each key channel's score, as ``ThinKPress.compress`` computes it (in the
    model dtype); a left-padded batch row by row on its real tokens (its window: its last ``window`` ones)."""
    keys = ctx.keys
    b, kv_heads, length, d = keys.shape
    n = min(window, ctx.hidden_states.shape[1])
    queries = ctx.queries(n)  # [b, H, n, d]
    groups = queries.shape[1] // kv_heads

    def scores(rows: slice, first: int) -> torch.Tensor:
        own = queries[rows, :, max(0, first - (length - n)):]
        queries_norm = torch.pow(own, 2).mean(dim=2).view(-1, kv_heads, groups, d)
        queries_norm = queries_norm.mean(2) if gqa == "mean" else queries_norm.amax(2)
        keys_norm = torch.pow(keys[rows, :, first:], 2).mean(dim=2)
        return queries_norm * keys_norm

    if ctx.pad_mask is None:
        return scores(slice(None), 0)
    pads = (~ctx.pad_mask).sum(dim=1).tolist()
    return torch.cat([scores(slice(row, row + 1), pad) for row, pad in enumerate(pads)])


@register
@dataclass
class ThinK(Method):
    method = "think"
    display_name = "ThinK"
    kvpress_entries = {"think": {
        "placements": (),  # kvpress's leaderboard sweeps compression_ratio, which ThinK does not take
        "parity": "kept key channels and tokens equal (tested; every position kept, the channels stored alone)"}}
    paper = "ThinK, arXiv 2407.21018"
    reference = ("kvpress 0.5.5 `ThinKPress` (the last 32 queries' mean square, averaged per KV group, times the "
                 "keys' mean square per channel; the lowest `key_channel_compression_ratio` of each head's "
                 "channels pruned)")
    budget_meaning = ("every token is kept (`budget`/`ratio` do not apply); `key_channel_ratio`: the share of "
                      "each KV head's key channels dropped from the prompt's keys")
    deviations = ("the prompt's keys store only the kept channels (kvpress zeroes the others and keeps their "
                  "memory); attention over them is the same")
    derived = ("budget", "ratio")  # every token is kept: no size in tokens
    tag_parts = ("kc{key_channel_ratio}", "w{window}", "{gqa}")
    stores_key_channels = True
    scores_while_decoding = False  # its channels are chosen once, over the prompt
    budget: int | None = None
    ratio: float | None = 0.0
    key_channel_ratio: float = 0.5

    def validate(self) -> None:
        # every token is kept: like kvpress's evaluate.py for this press, a run's token budget or ratio does not apply
        self.budget, self.ratio = None, 0.0
        check_int("window", self.window, 1)
        check_choice("gqa", self.gqa, ("mean", "max"))
        value = self.key_channel_ratio
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise InputError(f"key_channel_ratio={value!r} must be a number in [0, 1): the share of each KV head's "
                             "key channels dropped")
        self.key_channel_ratio = float(value)

    def takes_padded_batch(self) -> bool:
        return self.pads_batches  # no share of the prompt is taken

    def budget_for(self, length: int) -> int:
        return length

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        return 0  # nothing is cut; ``window`` is the queries scoring the channels

    def select(self, ctx, budget: int, window: int):
        b, heads, length, _ = ctx.keys.shape
        return torch.arange(length, device=ctx.keys.device).expand(b, heads, length), None

    def key_channels(self, ctx):
        d = ctx.keys.shape[-1]
        pruned = int(d * self.key_channel_ratio)
        if pruned == 0:
            return None
        scores = ctx.shared(("think_channels", self.window, self.gqa),
                            lambda: channel_scores(ctx, self.window, self.gqa))
        kept = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
        kept.scatter_(-1, scores.topk(pruned, dim=-1, largest=False).indices, False)
        every = torch.arange(d, device=scores.device).expand(scores.shape)
        return every[kept].view(*scores.shape[:2], d - pruned)

    def stored_key_channels(self, head_dim: int) -> int:
        return head_dim - int(head_dim * self.key_channel_ratio)

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return self.window  # the window's queries

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The window's queries and their squares, then the keys squared (kvpress's ``pow``: one layer's keys);
        the kept channels gathered afterwards take less than the latter."""
        window = min(self.window, length)
        queries = 2 * batch * shape.heads * window * shape.head_dim * nbytes
        return queries + batch * shape.kv_heads * length * shape.head_dim * nbytes

    def label(self) -> str:
        changed = [f"{f.name} {getattr(self, f.name)}" for f in fields(self)
                   if f.name not in ("budget", "ratio", "key_channel_ratio") and getattr(self, f.name) != f.default]
        return f"{self.display_name} key_channel_ratio {self.key_channel_ratio:g}" + (
            f" ({', '.join(changed)})" if changed else "")
