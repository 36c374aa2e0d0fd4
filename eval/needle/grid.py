"""Needle grids: explicit lists, linear ranges, and the SnapKV paper's figure.

The paper's LWM-Text-Chat-1M figure has 45 "Token Limit" columns: 20 points of
``round(linspace(1000, 131257, 21))`` without the last (1000, 7513, ... 124744), then 25 points of
``round(linspace(134000, 400000, 27))`` (134000, 144231, ... 379538), and 10 depths
``round(linspace(0, 100, 10))`` (0, 11, 22, ... 100). numpy rounds half to even, as the figure did.
"""
from __future__ import annotations

from snapkv.errors import InputError

import numpy as np

GRIDS = ("linear", "paper")


def paper_lengths() -> list[int]:
    first = np.round(np.linspace(1000, 131257, 21)).astype(int)[:20]
    second = np.round(np.linspace(134000, 400000, 27)).astype(int)[:25]
    return [int(n) for n in (*first, *second)]


def paper_depths() -> list[float]:
    return [float(d) for d in np.round(np.linspace(0, 100, 10))]


def linear(start: int, stop: int, points: int) -> list[int]:
    if points < 1 or start < 1 or stop < start:
        raise InputError(f"needle grid: need 1 <= min_length <= max_length and num_lengths >= 1 "
                         f"(got {start}, {stop}, {points})")
    return [int(n) for n in np.round(np.linspace(start, stop, points))]


def numbers(value, field: str, kind=int) -> list:
    """A list of numbers as typed on the command line: ``[1000,2000]``, a single ``1000``, or quoted."""
    values = [value] if isinstance(value, (str, int, float)) else list(value)
    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise ValueError
            number = kind(float(v)) if kind is int else kind(v)
            if kind is int and float(v) != number:
                raise ValueError
        except (TypeError, ValueError):
            raise InputError(f"{field}: {v!r} is not a{'n integer' if kind is int else ' number'}") from None
        out.append(number)
    return out


def lengths_from(cfg) -> list[int]:
    if cfg.get("lengths") is not None:
        lengths = numbers(cfg.lengths, "needle.lengths")
    elif cfg.grid == "paper":
        lengths = paper_lengths()
    elif cfg.grid == "linear":
        lengths = linear(*numbers([cfg.min_length, cfg.max_length, cfg.num_lengths], "needle.min/max/num_lengths"))
    else:
        raise InputError(f"needle.grid={cfg.grid!r} is not allowed; choose {' or '.join(GRIDS)} "
                         "(or set needle.lengths)")
    if not lengths or any(n < 1 for n in lengths):
        raise InputError(f"needle.lengths={lengths}: give positive token counts")
    return sorted(set(lengths))


def depths_from(cfg) -> list[float]:
    if cfg.get("depths") is not None:
        depths = numbers(cfg.depths, "needle.depths", float)
    elif cfg.get("num_depths") is None and cfg.grid == "paper":
        depths = paper_depths()
    else:
        n = numbers(cfg.num_depths if cfg.get("num_depths") is not None else 5, "needle.num_depths")[0]
        if n < 1:
            raise InputError(f"needle.num_depths={n} must be >= 1")
        depths = [float(d) for d in np.linspace(0, 100, n)] if n > 1 else [0.0]
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad or not depths:
        raise InputError(f"needle.depths={bad or depths}: depths are percents in [0, 100]")
    return sorted(set(depths))
