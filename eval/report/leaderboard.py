"""The kvpress leaderboard's table and figure from RULER runs made with ``compressor.ratio`` (the preset
``experiment=kvpress_leaderboard``): per model, length and question placement, one row a method, one
column a compression ratio, the RULER average in each cell; ratio 0 is full KV, where every method's
line starts (as the leaderboard draws it). Runs given a budget in tokens are not leaderboard points."""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..plotting import save_figure
from .collect import label_of

FULL = "FullKV"
PARTIAL = "_partial"  # a board's (method, ratio) cells averaged over fewer than RULER's 13 tasks


def method_name(compressor: dict) -> str:
    """A run's setting without its size: ``SnapKV (window 64, kernel 5, pooling avgpool)``."""
    return label_of(compressor).replace(f" ratio {float(compressor['ratio']):g}", "", 1)


def leaderboard_points(runs: list[dict]) -> dict:
    """``{(model, length, query_aware): {method: {ratio: average}}}``; full KV is ratio 0 of ``FullKV``."""
    boards: dict = {}
    for r in runs:
        compressor = r.get("compressor") or {}
        ratio = 0.0 if r["method"] == "full" else compressor.get("ratio")
        if ratio is None:
            continue
        name = FULL if r["method"] == "full" else method_name(compressor)
        for length, one in r["by_length"].items():
            key = (r["model"], int(length), r.get("query_aware", True))
            boards.setdefault(key, {}).setdefault(name, {})[float(ratio)] = one["average"]
            if not one.get("complete", True):
                boards[key].setdefault(PARTIAL, set()).add((name, float(ratio)))
    return boards


def _title(model: str, length: int, query_aware: bool) -> str:
    placement = "query-aware" if query_aware else "query-agnostic"
    return f"{model}, RULER {length} tokens, {placement}"


def write_leaderboard(runs: list[dict], out: Path) -> list[Path]:
    boards = {key: board for key, board in leaderboard_points(runs).items()
              if any(name not in (FULL, PARTIAL) for name in board)}
    if not boards:
        return []
    md = ["# KV-cache compression leaderboard (kvpress's protocol)", "",
          "RULER average (13 tasks unless fewer ran) by compression ratio (`compressor.ratio`: the share of the",
          "prompt's KV removed); ratio 0 is full KV. Methods ranked by their average over the ratios run.", ""]
    rows, written = [], []
    for (model, length, query_aware), board in sorted(boards.items()):
        partial = board.pop(PARTIAL, set())
        ratios = sorted({x for points in board.values() for x in points} | {0.0})
        full = board.get(FULL, {}).get(0.0)
        md += [f"## {_title(model, length, query_aware)}", "",
               "| method | " + " | ".join(f"{x:g}" for x in ratios) + " | average |",
               "|---|" + "---|" * (len(ratios) + 1)]
        methods = [name for name in board if name != FULL]
        ranked = sorted(methods, key=lambda n: -_mean([v for x, v in board[n].items() if x > 0]))
        for name in ([FULL] if full is not None else []) + ranked:
            points = dict(board[name])
            if name != FULL and full is not None:
                points.setdefault(0.0, full)
            compressed = [v for x, v in points.items() if x > 0]
            cells = ["–" if points.get(x) is None else
                     f"{points[x]:.2f}" + ("*" if (FULL if x == 0 else name, x) in partial else "") for x in ratios]
            average = f"{_mean(compressed):.2f}" if compressed else "–"
            md.append(f"| {name} | " + " | ".join(cells) + f" | {average} |")
            rows += [{"model": model, "length": length, "query_aware": query_aware, "method": name, "ratio": x,
                      "ruler_average": v} for x, v in sorted(points.items())]
        if partial:
            md += ["", "\\* averaged over fewer than RULER's 13 tasks (see ruler.md for which)."]
        md.append("")
        written += _figure(board, full, out, model, length, query_aware)
    (out / "leaderboard.md").write_text("\n".join(md), encoding="utf-8")
    with open(out / "leaderboard.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "length", "query_aware", "method", "ratio", "ruler_average"])
        writer.writeheader()
        writer.writerows(rows)
    return [out / "leaderboard.md", out / "leaderboard.csv", *written]


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _figure(board: dict, full, out: Path, model: str, length: int, query_aware: bool) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in sorted(board.items()):
        if name == FULL:
            continue
        points = dict(points)
        if full is not None:
            points.setdefault(0.0, full)
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    if full is not None:
        ax.axhline(full, linestyle="--", color="black", linewidth=1, label=FULL)
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("RULER average")
    ax.set_title(_title(model, length, query_aware), fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    placement = "aware" if query_aware else "agnostic"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model)
    return save_figure(fig, out / f"leaderboard_{safe}_{length}_{placement}.png")
