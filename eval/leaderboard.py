"""The kvpress leaderboard's protocol as constants (NVIDIA/kvpress ``evaluation/``; docs/leaderboard.md):
the entries here that it ranks, its compression ratios and its SnapKV-family defaults. The preset
``conf/experiment/kvpress_leaderboard.yaml`` and ``eval.bench``'s ``leaderboard`` sweep read the same
list (a test keeps the preset equal to it)."""
from __future__ import annotations

# compressor option -> the fields it sets (an option named after a method is that method's defaults);
# kvpress's registry names in docs/leaderboard.md
ENTRIES = {
    "random": {}, "knorm": {}, "streamingllm": {}, "tova": {}, "keydiff": {}, "expected_attention": {},
    "snapkv": {}, "pyramidkv": {}, "adakv": {}, "critical_adakv": {},
    # kvpress's "expected_attention" entry: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
    "adakv_expected_attention": {"method": "adakv", "scorer": "expected_attention", "scorer_epsilon": 0.01},
    "kvzip": {},
}
# our entry (and full KV) -> kvpress's name for it: its registry entry (``evaluation/evaluate_registry.py``), or
# the press's class where the registry has no entry of it; the report names rows and lines with it
KVPRESS_NAMES = {
    "full": "no_press", "random": "random", "knorm": "knorm", "streamingllm": "streaming_llm", "tova": "tova",
    "keydiff": "keydiff", "expected_attention": "ExpectedAttentionPress", "snapkv": "snapkv",
    "pyramidkv": "pyramidkv", "adakv": "adakv_snapkv", "critical_adakv": "critical_adakv_snapkv",
    "adakv_expected_attention": "expected_attention", "kvzip": "kvzip",
}
RATIOS = (0.25, 0.5, 0.75, 0.875)
LENGTH = 4096
# kvpress's SnapKVPress / PyramidKVPress / AdaKV scorer defaults (fields other methods do not read are dropped)
WINDOW_FAMILY = {"window": 64, "kernel": 5, "pooling": "avgpool"}


def settings() -> list[dict]:
    """Full KV, then every entry at every ratio, as ``{method, field: value}`` mappings."""
    return [{"method": "full"}] + [{"method": name, **WINDOW_FAMILY, **fields, "budget": None, "ratio": r}
                                   for name, fields in ENTRIES.items() for r in RATIOS]
