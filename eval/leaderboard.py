"""The kvpress leaderboard's protocol (NVIDIA/kvpress ``evaluation/``; docs/leaderboard.md): its entries
here, its compression ratios and its SnapKV-family defaults. The entries come from the method registry:
each method's file says which kvpress registry entries it is (``Method.kvpress_entries``). The preset
``conf/experiment/kvpress_leaderboard.yaml`` and ``eval.bench``'s ``leaderboard`` sweep read the same list
(a test keeps the preset equal to it)."""
from __future__ import annotations

from pathlib import Path

import snapkv
import snapkv.registry


def _entries(placement: str | None = None) -> tuple[dict, dict]:
    """``(entries, names)``: compressor option -> the fields it sets (``{}``: the method's own option with its
    defaults), and our option (and full KV) -> kvpress's name for it: its registry entry, or the press's class
    where the registry has no entry of it; the report names rows and lines with it."""
    entries, names = {}, {}
    for option, (method, press, fields) in snapkv.registry.kvpress_entries(placement).items():
        names[option] = press
        if snapkv.METHODS[method]().compresses:  # full KV is the baseline, ratio 0 of every line
            entries[option] = {"method": method, **fields} if option != method else {}
    return entries, names


ENTRIES = _entries("agnostic")[0]  # the query-agnostic board: the preset and the bench's leaderboard sweep
ALL_ENTRIES, KVPRESS_NAMES = _entries()  # either board: the report names every run of an entry by kvpress's name
RATIOS = (0.25, 0.5, 0.75, 0.875)
LENGTH = 4096
# kvpress's SnapKVPress / PyramidKVPress / AdaKV scorer defaults (fields other methods do not read are dropped)
WINDOW_FAMILY = {"window": 64, "kernel": 5, "pooling": "avgpool"}


def settings() -> list[dict]:
    """Full KV, then every entry at every ratio, as ``{method, field: value}`` mappings."""
    return [{"method": "full"}] + [{"method": name, **WINDOW_FAMILY, **fields, "budget": None, "ratio": r}
                                   for name, fields in ENTRIES.items() for r in RATIOS]


PRESETS = {"agnostic": Path(__file__).resolve().parent.parent / "conf/experiment/kvpress_leaderboard.yaml",
           "aware": Path(__file__).resolve().parent.parent / "conf/experiment/kvpress_leaderboard_query_aware.yaml"}


def preset_options(placement: str = "agnostic") -> str:
    """A preset's ``compressor`` sweep: full KV and every entry of that board."""
    return ",".join(["full", *_entries(placement)[0]])


def with_preset_options(text: str, placement: str) -> str:
    """A preset file's text with its ``compressor:`` sweep line generated from the registry."""
    lines = [f"      compressor: {preset_options(placement)}" if line.startswith("      compressor: ") else line
             for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def write_presets() -> list[Path]:
    for placement, path in PRESETS.items():
        path.write_text(with_preset_options(path.read_text(encoding="utf-8"), placement), encoding="utf-8")
    return list(PRESETS.values())
