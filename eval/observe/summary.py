"""Hit-rate tables and the paper's Figures 2 and 3, from ``hits.jsonl`` (one line a sample)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ..plotting import save_figure


def cube(samples: list[dict], figure: int) -> np.ndarray:
    """``[samples, layers, windows, heads]`` hit rates (NaN where a head had no important pair)."""
    layers = 1 + max(r["layer"] for s in samples for r in s["records"])
    windows = 1 + max((r["window"] for s in samples for r in s["records"] if r["figure"] == figure), default=-1)
    heads = len(samples[0]["records"][0]["heads"])
    out = np.full((len(samples), layers, max(windows, 0), heads), np.nan)
    for i, s in enumerate(samples):
        for r in s["records"]:
            if r["figure"] == figure:
                out[i, r["layer"], r["window"]] = [np.nan if v is None else v for v in r["heads"]]
    return out


def _mean(a: np.ndarray, axis) -> np.ndarray:
    """``nanmean`` without the warning for all-NaN slices (they stay NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=axis)


def _fmt(v) -> str:
    return "–" if v is None or np.isnan(v) else f"{v:.3f}"


def tables(samples: list[dict], settings: str) -> str:
    fig2, fig3 = cube(samples, 2), cube(samples, 3)
    by_layer3 = _mean(fig3, (0, 3))          # [layers, response windows]
    by_layer2 = _mean(fig2, (0, 3))          # [layers, prompt windows]
    lines = [f"# Observation-window hit rates ({len(samples)} samples; {settings})", "",
             "## Figure 3: the last prompt window against each response window (mean over heads and samples)", "",
             "| layer | " + " | ".join(f"response window {j + 1}" for j in range(by_layer3.shape[1])) + " |",
             "|---|" + "---|" * by_layer3.shape[1]]
    lines += [f"| {layer} | " + " | ".join(_fmt(v) for v in row) + " |" for layer, row in enumerate(by_layer3)]
    lines += ["", "Mean over layers: " + ", ".join(_fmt(v) for v in _mean(by_layer3, 0)), "",
              "## Figure 2: each of the prompt's last windows against the response (window 1 is the farthest "
              "from the response)", "",
              "| layer | " + " | ".join(str(i + 1) for i in range(by_layer2.shape[1])) + " |",
              "|---|" + "---|" * by_layer2.shape[1]]
    lines += [f"| {layer} | " + " | ".join(_fmt(v) for v in row) + " |" for layer, row in enumerate(by_layer2)]
    per_head = _mean(fig3, (0, 2))            # [layers, heads]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = np.nanstd(_mean(fig3, 0), axis=1)  # [layers, heads]: across response windows
    order = [(l, h) for l, h in np.ndindex(per_head.shape) if not np.isnan(per_head[l, h])]
    order.sort(key=lambda lh: -per_head[lh])
    lines += ["", "## Heads (Figure 3 protocol): most and least consistent", "",
              "| layer | head | mean hit rate | std over response windows |", "|---|---|---|---|"]
    for l, h in order[:10] + (order[-10:] if len(order) > 20 else order[10:]):
        lines.append(f"| {l} | {h} | {_fmt(per_head[l, h])} | {_fmt(spread[l, h])} |")
    return "\n".join(lines) + "\n"


def figures(samples: list[dict], out: Path, title: str, prefix: str = "") -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    fig2 = _mean(cube(samples, 2), (0, 3))   # [layers, windows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = plt.cm.viridis(np.linspace(0, 1, fig2.shape[0]))
    x = np.arange(1, fig2.shape[1] + 1)
    for layer, row in enumerate(fig2):
        ax.plot(x, row, color=colours[layer], linewidth=1)
    ax.set_xticks(x)
    ax.set_xlabel("prompt window (1 = farthest from the response)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}: prompt windows vs the response (one line a layer)", fontsize=9)
    bar = fig.colorbar(plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(0, fig2.shape[0] - 1)), ax=ax)
    bar.set_label("layer")
    fig.tight_layout()
    paths += save_figure(fig, out / f"{prefix}figure2_prompt_windows.png")
    fig3 = _mean(cube(samples, 3), (0, 3))   # [layers, response windows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for j in range(fig3.shape[1]):
        ax.plot(np.arange(fig3.shape[0]), fig3[:, j], marker="o", markersize=3, label=f"response window {j + 1}")
    ax.set_xlabel("layer")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}: last prompt window vs response windows", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths += save_figure(fig, out / f"{prefix}figure3_response_windows.png")
    return paths


def overlap_table(lines: list[dict]) -> str:
    layers = np.array([[np.nan if v is None else v for v in layer] for line in lines for layer in [*line["layers"]]])
    n_layers = len(lines[0]["layers"])
    per_layer = _mean(layers.reshape(len(lines), n_layers, -1), (0, 2))
    out = ["# The same document with different instructions: overlap of the selected positions", "",
           f"{len(lines)} prompt pairs; mean share of one selection also in the other, over heads.", "",
           "| layer | overlap |", "|---|---|"]
    out += [f"| {l} | {_fmt(v)} |" for l, v in enumerate(per_layer)]
    return "\n".join(out) + "\n"
