"""Paper-style needle heatmaps: x = context length, y = depth percent, red-yellow-green score."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def grid_of(cells: list[dict]):
    lengths = sorted({c["context_length"] for c in cells})
    depths = sorted({c["depth_percent"] for c in cells})
    scores = np.full((len(depths), len(lengths)), np.nan)
    oom = np.zeros_like(scores, dtype=bool)
    for c in cells:
        i, j = depths.index(c["depth_percent"]), lengths.index(c["context_length"])
        if c.get("oom"):
            oom[i, j] = True
        else:
            scores[i, j] = c["score"]
    return lengths, depths, scores, oom


def _label(n: int) -> str:
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def draw(ax, cells: list[dict], title: str, trained_context: int | None = None):
    lengths, depths, scores, oom = grid_of(cells)
    image = ax.imshow(scores, cmap=CMAP, vmin=0, vmax=1, aspect="auto", origin="upper")
    for i, j in zip(*np.nonzero(oom)):
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#d9d9d9", edgecolor="#7f7f7f",
                                   hatch="///", linewidth=0.5))
        ax.text(j, i, "OOM", ha="center", va="center", fontsize=6, color="#404040")
    ax.set_xticks([j - 0.5 for j in range(1, len(lengths))], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(depths))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(len(lengths)), [_label(n) for n in lengths], rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    ax.set_xlabel("Token Limit")
    ax.set_ylabel("Depth Percent")
    ax.set_title(title, fontsize=9)
    if trained_context and lengths[0] < trained_context < lengths[-1] * 1.0001:
        x = next(j for j, n in enumerate(lengths) if n > trained_context) - 0.5
        ax.axvline(x, color="black", linestyle="--", linewidth=1.2)
    return image


def save_heatmap(cells: list[dict], path: Path, title: str, trained_context: int | None = None) -> list[Path]:
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len({c['context_length'] for c in cells}) + 3), 4.5))
    image = draw(ax, cells, title, trained_context)
    fig.colorbar(image, ax=ax, label="Score")
    fig.tight_layout()
    return _save(fig, Path(path))


def save_side_by_side(runs: list[tuple[str, list[dict]]], path: Path, trained_context: int | None = None):
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (title, cells) in zip(axes[0], runs):
        image = draw(ax, cells, title, trained_context)
    fig.colorbar(image, ax=list(axes[0]), label="Score")
    return _save(fig, Path(path))


def _save(fig, path: Path) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    outs = [path.with_suffix(".png"), path.with_suffix(".pdf")]
    for out in outs:
        fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return outs
