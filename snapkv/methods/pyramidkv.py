"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scoring with budgets that shrink with depth.

The per-layer budgets follow the official code, KVCache-Factory ``pyramidkv/pyramidkv_utils.py``
(``PyramidKVCluster.update_kv``), every branch. With ``c = budget - window`` and a prompt of
``L`` tokens:
- ``L < budget``: every layer keeps everything;
- ``L < 2c``: every layer keeps ``budget`` (uniform);
- otherwise layer ``i`` keeps ``window + max - i * ((max - min) // (layers - 1))`` with
  ``min = c // beta`` and ``max = 2c - min``; when ``max >= L - window``, ``max`` is clamped to
  ``L - window`` and ``min = 2c - max``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import check_int
from ..observation_window import WindowVoteMethod
from ..registry import register


@register
@dataclass
class PyramidKV(WindowVoteMethod):
    method = "pyramidkv"
    display_name = "PyramidKV"
    kvpress_entries = {"pyramidkv": {}}
    paper = "PyramidKV, arXiv 2406.02069"
    reference = ("KVCache-Factory `pyramidkv/pyramidkv_utils.py` `PyramidKVCluster.update_kv` (every branch, tested "
                 "on transcribed cases)")
    budget_meaning = ("the mean over layers (integer steps make it slightly off); all kept below `budget`, uniform "
                      "below 2 (budget - window)")
    deviations = "per-layer budgets need a batch without padding"
    tag_parts = ("w{window}", "k{kernel}", "{pooling}", "{gqa}", "beta{beta}")
    beta: int = 20
    pads_batches = False  # its layers' budgets differ: a padded batch is refused

    def validate(self) -> None:
        super().validate()
        check_int("beta", self.beta, 1)

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
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
