"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scoring with budgets that shrink with depth.

``schedule="kvcache_factory"`` (the default, the paper's): the per-layer budgets follow the official code,
KVCache-Factory ``pyramidkv/pyramidkv_utils.py`` (``PyramidKVCluster.update_kv``), every branch. With
``c = budget - window`` and a prompt of ``L`` tokens:
- ``L < budget``: every layer keeps everything;
- ``L < 2c``: every layer keeps ``budget`` (uniform);
- otherwise layer ``i`` keeps ``window + max - i * ((max - min) // (layers - 1))`` with
  ``min = c // beta`` and ``max = 2c - min``; when ``max >= L - window``, ``max`` is clamped to
  ``L - window`` and ``min = 2c - max``.

``schedule="kvpress"``: as kvpress 0.5.5 ``PyramidKVPress`` (its registry entry ``pyramidkv``, option
``pyramidkv_kvpress``, with kvpress's window 64, kernel 5 and average pooling) runs it, a float variant of
the above that always applies the ratio. With ``n = L * (1 - ratio)`` (or ``budget``),
``min = n / beta``, ``max = 2n - min``, and ``max`` clamped to ``L - window`` (then ``min = 2n - max``) as
above, layer ``i`` keeps ``round(max - i * (max - min) / (layers - 1))`` positions, the window among them;
when ``L >= max >= min >= window`` does not hold, every layer keeps ``max(1, round(n))`` (SnapKV). The
positions are kvpress's SnapKV scores' top-k: the window's attention averaged over its queries, pooled, the
window above every other position (so a layer keeping fewer than the window keeps the part of it
``torch.topk`` picks among equal scores, as kvpress's does). A prompt not longer than the window is kept whole
(kvpress refuses it).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import check_choice, check_int
from ..observation_window import WindowVoteMethod, window_votes
from ..registry import register
from ..select import aggregate_heads, always_kept, pool, top_positions

SCHEDULES = ("kvcache_factory", "kvpress")


@register
@dataclass
class PyramidKV(WindowVoteMethod):
    method = "pyramidkv"
    display_name = "PyramidKV"
    # kvpress's PyramidKVPress(): its schedule and its SnapKV defaults, so the option alone is kvpress's press
    kvpress_entries = {"pyramidkv": {"schedule": "kvpress", "window": 64, "kernel": 5, "pooling": "avgpool",
                                     "option": "pyramidkv_kvpress"}}
    paper = "PyramidKV, arXiv 2406.02069"
    reference = ("KVCache-Factory `pyramidkv/pyramidkv_utils.py` `PyramidKVCluster.update_kv` (every branch, tested "
                 "on transcribed cases); `schedule=kvpress`: kvpress 0.5.5 `PyramidKVPress` (parity-tested)")
    budget_meaning = ("the mean over layers (integer steps make it slightly off); all kept below `budget`, uniform "
                      "below 2 (budget - window); `schedule=kvpress`: kvpress's rounded float schedule")
    deviations = ("per-layer budgets need a batch without padding; `schedule=kvpress` keeps a prompt not longer "
                  "than the window whole (kvpress refuses it)")
    tag_parts = ("w{window}", "k{kernel}", "{pooling}", "{gqa}", "{schedule}", "beta{beta}")
    beta: int = 20
    schedule: str = "kvcache_factory"
    pads_batches = False  # its layers' budgets differ: a padded batch is refused
    scores_while_decoding = False  # its pyramid is a schedule over a prompt's layers; SnapKV cuts while decoding

    def validate(self) -> None:
        super().validate()
        check_int("beta", self.beta, 1)
        check_choice("schedule", self.schedule, SCHEDULES)

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        if self.schedule == "kvpress":
            return self._kvpress_budget(layer_idx, num_layers, length)
        budget = self.budget_for(length)
        capacity = budget - self.window
        if length < budget:
            return length
        if length < 2 * capacity:
            return budget
        smallest = capacity // self.beta
        largest = 2 * capacity - smallest
        if largest >= length - self.window:
            largest = length - self.window
            smallest = 2 * capacity - largest
        step = (largest - smallest) // (num_layers - 1) if num_layers > 1 else 0
        return self.window + largest - layer_idx * step

    def _kvpress_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        """kvpress's ``PyramidKVPress.get_layer_budget``, step by step (its float arithmetic included)."""
        if length <= self.window:
            return length
        kept = length * (1 - self.ratio) if self.ratio is not None else self.budget
        max_capacity_prompt = self.window + kept
        smallest = (max_capacity_prompt - self.window) / self.beta
        largest = (max_capacity_prompt - self.window) * 2 - smallest
        if largest >= length - self.window:
            largest = length - self.window
            smallest = (max_capacity_prompt - self.window) * 2 - largest
        if not (length >= largest >= smallest >= self.window):
            return min(length, max(1, round(kept)))
        steps = (largest - smallest) / (num_layers - 1) if num_layers > 1 else 0.0
        return round(largest - layer_idx * steps)

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        if self.schedule != "kvpress":
            return self.window
        # kvpress's top-k keeps the whole window where the layer keeps that many, else part of it
        return self.window if self.layer_budget(layer_idx, num_layers, length) >= self.window else 0

    def select(self, ctx, budget: int, window: int):
        if self.schedule != "kvpress":
            return super().select(ctx, budget, window)
        # kvpress's SnapKVPress.score, then ScorerPress's top-k of the layer's budget
        _, votes = window_votes(ctx, self.window)
        scores = aggregate_heads(pool(votes, self.pooling, self.kernel), ctx.keys.shape[1], self.gqa)
        return top_positions(always_kept(scores, last=self.window), budget, ctx.pad_mask), None
