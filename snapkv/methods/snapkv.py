"""SnapKV (arXiv 2404.14469): the observation window votes for the positions every head keeps.

Selection equals the official SnapKV ``SnapKVCluster.update_kv`` (FasterDecoding/SnapKV
``snapkv_utils.py``; ``snapkv.select``). As the scorer of a wrapper (AdaKV's default) it scores as
kvpress 0.5.5's ``SnapKVPress``: the window's attention averaged over its queries, the window itself
above every other position.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..observation_window import WindowVoteMethod, window_votes
from ..registry import register
from ..select import aggregate_heads, always_kept, pool


@register
@dataclass
class SnapKV(WindowVoteMethod):
    """Defaults are the paper's LongBench setting (the official SnapKV LongBench configs): window 32,
    kernel 7, max pooling."""

    method = "snapkv"
    display_name = "SnapKV"
    paper = "SnapKV, arXiv 2404.14469"
    reference = "FasterDecoding/SnapKV `snapkv_utils.py` `SnapKVCluster.update_kv`"
    budget_meaning = "tokens kept per head, the window included (`max_capacity_prompt`)"
    deviations = "`gqa=mean` default (official: `repeat`); kept positions sorted"
    scores_positions = True
    kvpress_entries = {"snapkv": {  # on both of kvpress's boards
        "placements": ("agnostic", "aware"),
        "parity": "equal where kvpress's `n_kept` is at least the window + 1 (below); window 64, kernel 5, avgpool "
                  "as in the presets"}}

    def prompt_scores(self, ctx):
        _, votes = window_votes(ctx, self.window)
        scores = aggregate_heads(pool(votes, self.pooling, self.kernel), ctx.keys.shape[1], self.gqa)
        return always_kept(scores, last=self.window)
