"""The kvpress leaderboard's protocol as constants (NVIDIA/kvpress ``evaluation/``; docs/leaderboard.md):
the methods here that it ranks, its compression ratios and its SnapKV-family defaults. The preset
``conf/experiment/kvpress_leaderboard.yaml`` and ``eval.bench``'s ``leaderboard`` sweep read the same
list (a test keeps the preset equal to it)."""
from __future__ import annotations

METHODS = ("random", "knorm", "streamingllm", "tova", "keydiff", "expected_attention", "snapkv", "pyramidkv",
           "adakv", "critical_adakv")
RATIOS = (0.25, 0.5, 0.75, 0.875)
LENGTH = 4096
# kvpress's SnapKVPress / PyramidKVPress / AdaKV scorer defaults (fields other methods do not read are dropped)
WINDOW_FAMILY = {"window": 64, "kernel": 5, "pooling": "avgpool"}


def settings() -> list[dict]:
    """Full KV, then every method at every ratio, as ``{method, field: value}`` mappings."""
    return [{"method": "full"}] + [{"method": m, "budget": None, "ratio": r, **WINDOW_FAMILY}
                                   for m in METHODS for r in RATIOS]
