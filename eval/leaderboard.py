"""The kvpress leaderboard's protocol (NVIDIA/kvpress ``evaluation/``; docs/leaderboard.md): its entries
here, its compression ratios and its SnapKV-family defaults. The entries come from the method registry:
each method's file says which kvpress registry entries it is (``Method.kvpress_entries``). The preset
``conf/experiment/kvpress_leaderboard.yaml`` and ``eval.bench``'s ``leaderboard`` sweep read the same list
(a test keeps the preset equal to it)."""
from __future__ import annotations

import snapkv


def _entries() -> tuple[dict, dict]:
    """``(entries, names)``: compressor option -> the fields it sets (an option named after a method is that
    method's defaults; an entry with fields of its own is the option ``<method>_<kvpress name>``), and our
    option (and full KV) -> kvpress's name for it: its registry entry, or the press's class where the
    registry has no entry of it; the report names rows and lines with it."""
    entries, names = {}, {}
    for method, cls in sorted(snapkv.METHODS.items()):
        for press, fields in cls.kvpress_entries.items():
            if not cls().compresses:  # full KV: the baseline, ratio 0 of every line
                names[method] = press
                continue
            option = f"{method}_{press}" if fields else method
            entries[option] = {"method": method, **fields} if fields else {}
            names[option] = press
    return entries, names


ENTRIES, KVPRESS_NAMES = _entries()
RATIOS = (0.25, 0.5, 0.75, 0.875)
LENGTH = 4096
# kvpress's SnapKVPress / PyramidKVPress / AdaKV scorer defaults (fields other methods do not read are dropped)
WINDOW_FAMILY = {"window": 64, "kernel": 5, "pooling": "avgpool"}


def settings() -> list[dict]:
    """Full KV, then every entry at every ratio, as ``{method, field: value}`` mappings."""
    return [{"method": "full"}] + [{"method": name, **WINDOW_FAMILY, **fields, "budget": None, "ratio": r}
                                   for name, fields in ENTRIES.items() for r in RATIOS]


def preset_options() -> str:
    """The preset's ``compressor`` sweep: full KV and every entry."""
    return ",".join(["full", *ENTRIES])
