"""The usual needle grids: explicit lists, linear ranges, and the SnapKV paper's 1K-380K."""
from __future__ import annotations

PAPER_MIN, PAPER_MAX, PAPER_POINTS = 1000, 380000, 20


def linear(start: int, stop: int, points: int) -> list[int]:
    if points < 1 or start < 1 or stop < start:
        raise ValueError(f"needle grid: need 1 <= start <= stop and points >= 1 (got {start}, {stop}, {points})")
    if points == 1:
        return [int(start)]
    return [int(round(start + i * (stop - start) / (points - 1))) for i in range(points)]


def lengths_from(cfg) -> list[int]:
    if cfg.get("lengths"):
        lengths = [int(x) for x in cfg.lengths]
    elif cfg.grid == "paper":
        lengths = linear(PAPER_MIN, PAPER_MAX, PAPER_POINTS)
    elif cfg.grid == "linear":
        lengths = linear(int(cfg.min_length), int(cfg.max_length), int(cfg.num_lengths))
    else:
        raise ValueError(f"needle.grid={cfg.grid!r} is not allowed; choose paper or linear (or set needle.lengths)")
    if any(n < 64 for n in lengths):
        raise ValueError(f"needle.lengths={lengths}: every length must be at least 64 tokens")
    return sorted(set(lengths))


def depths_from(cfg) -> list[float]:
    if cfg.get("depths"):
        depths = [float(x) for x in cfg.depths]
    else:
        depths = [i * 100 / (int(cfg.num_depths) - 1) for i in range(int(cfg.num_depths))]
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise ValueError(f"needle.depths={bad}: depths are percents in [0, 100]")
    return sorted(set(depths))
