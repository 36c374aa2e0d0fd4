"""PyramidKV (arXiv 2406.02069): SnapKV scoring with budgets that shrink with depth.

The per-layer budgets follow the official PyramidKV arithmetic: with ``c = budget - window``,
``min = c // beta``, ``max = 2c - min`` and ``step = (max - min) // num_layers``, layer ``i``
keeps ``window + max - i * step`` tokens, so the mean over layers is about ``budget``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import check_int, register
from .snapkv import SnapKVConfig


@register
@dataclass
class PyramidKVConfig(SnapKVConfig):
    method = "pyramidkv"
    beta: int = 20

    def validate(self) -> None:
        super().validate()
        check_int("beta", self.beta, 1)

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        capacity = self.budget - self.window
        smallest = capacity // self.beta
        largest = 2 * capacity - smallest
        step = (largest - smallest) // num_layers
        return self.window + max(largest - layer_idx * step, 1)

