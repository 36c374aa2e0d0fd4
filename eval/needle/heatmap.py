"""Paper-style needle heatmaps: x = context length (exact token counts), y = depth percent,
red-yellow-green score 0-1, OOM cells hatched, the white dashed line where full KV ran out.

The SnapKV figure draws the dashed line at the longest length full KV handled before running out
of memory; it is taken from a full-KV run's OOM cells or from ``eval.bench`` rows (``oom``), and
left out when neither is known. The model's trained context, when inside the grid, is a second,
labelled dotted marker.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

from ..plotting import save_figure  # noqa: E402

CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def grid_of(cells: list[dict]):
    lengths = sorted({c["context_length"] for c in cells})
    depths = sorted({c["depth_percent"] for c in cells})
    scores = np.full((len(depths), len(lengths)), np.nan)
    status = np.full(scores.shape, "", dtype=object)
    for c in cells:
        i, j = depths.index(c["depth_percent"]), lengths.index(c["context_length"])
        if c.get("oom"):
            status[i, j] = "OOM"
        elif c.get("failed"):
            status[i, j] = "killed"
        else:
            scores[i, j] = c["score"]
    return lengths, depths, scores, status


def frontier_from_cells(cells: list[dict]) -> int | None:
    """The longest length before the first one with an OOM cell (None: no OOM, or OOM from the start)."""
    return _frontier([(c["context_length"], bool(c.get("oom"))) for c in cells])


def frontier_from_bench(rows: list[dict], batch: int = 1) -> int | None:
    """The same from ``eval.bench`` rows of full KV."""
    return _frontier([(r["input_tokens"], bool(r.get("oom"))) for r in rows
                      if r.get("method") == "full" and r.get("batch", 1) == batch])


def _frontier(points: list[tuple[int, bool]]) -> int | None:
    failed = [n for n, oom in points if oom]
    if not failed:
        return None
    ok = [n for n, oom in points if not oom and n < min(failed)]
    return max(ok) if ok else None


def _boundary(lengths: list[int], limit: int | None) -> float | None:
    """x of the column border right after the last length <= ``limit`` (None when not inside the grid)."""
    if limit is None or not lengths or limit < lengths[0] or limit >= lengths[-1]:
        return None
    return sum(1 for n in lengths if n <= limit) - 0.5


def draw(ax, cells: list[dict], title: str, frontier: int | None = None, trained_context: int | None = None):
    lengths, depths, scores, status = grid_of(cells)
    image = ax.imshow(scores, cmap=CMAP, vmin=0, vmax=1, aspect="auto", origin="upper")
    for i, j in zip(*np.nonzero(status != "")):
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#d9d9d9", edgecolor="#7f7f7f",
                                   hatch="///", linewidth=0.5))
        ax.text(j, i, status[i, j], ha="center", va="center", fontsize=5, color="#404040")
    ax.set_xticks([j - 0.5 for j in range(1, len(lengths))], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(depths))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=90, fontsize=6)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    ax.set_xlabel("Token Limit")
    ax.set_ylabel("Depth Percent")
    ax.set_title(title, fontsize=9)
    x = _boundary(lengths, frontier)
    if x is not None:
        ax.axvline(x, color="white", linestyle="--", linewidth=2)
    x = _boundary(lengths, trained_context)
    if x is not None:
        ax.axvline(x, color="#404040", linestyle=":", linewidth=1.2)
        ax.text(x, -0.6, " trained context", fontsize=6, color="#404040", va="bottom", ha="left")
    return image


def save_heatmap(cells: list[dict], path: Path, title: str, frontier: int | None = None,
                 trained_context: int | None = None) -> list[Path]:
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len({c['context_length'] for c in cells}) + 3), 4.8))
    image = draw(ax, cells, title, frontier, trained_context)
    fig.colorbar(image, ax=ax, label="Score")
    fig.tight_layout()
    return save_figure(fig, Path(path), bbox_inches="tight")


def save_side_by_side(runs: list[tuple[str, list[dict]]], path: Path, frontier: int | None = None,
                      trained_context: int | None = None) -> list[Path]:
    """Several runs with one colour scale (0-1) and one colour bar."""
    width = max(5, 0.3 * max(len({c["context_length"] for c in cells}) for _, cells in runs) + 2)
    fig, axes = plt.subplots(1, len(runs), figsize=(width * len(runs), 4.8), squeeze=False)
    for ax, (title, cells) in zip(axes[0], runs):
        image = draw(ax, cells, title, frontier, trained_context)
    fig.colorbar(image, ax=list(axes[0]), label="Score")
    return save_figure(fig, Path(path), bbox_inches="tight")
