"""Report figures: LongBench score vs budget, needle heatmaps and summary, speed/memory."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..plotting import line_styles, save_figure
from ..bench.tables import figure as bench_figure, markdown as bench_markdown
from ..needle.heatmap import frontier_from_bench, frontier_from_cells, save_heatmap, save_side_by_side


def file_name(kind: str, run: str) -> str:
    """``<kind>_<run folder>``, without repeating the task's own folder name (``needle_needle_...``)."""
    return run if run.startswith(f"{kind}_") else f"{kind}_{run}"


def _line_name(run: dict) -> str:
    """One line per (model, setting), the budget on the x axis."""
    setting = re.sub(r" \d+", "", run["label"], count=1)
    return f"{run['model']} {setting}"


def budget_curves(runs: list[dict], out: Path, file_name: str = "budget_curve") -> list[Path]:
    """Score vs budget, one panel per dataset (RULER: per length), one line per (model, method,
    pooling), each its own colour and marker (the same in every panel); full KV dashed."""
    datasets = sorted({d for r in runs for d, v in r["scores"].items() if isinstance(v, (int, float))})
    if not datasets:
        return []
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    styles = line_styles(_line_name(r) for r in runs if r["method"] != "full" and r["budget"] is not None)
    for ax, dataset in zip(axes[0], datasets):
        lines: dict = {}
        for r in runs:
            score = r["scores"].get(dataset)
            if not isinstance(score, (int, float)):
                continue
            if r["method"] == "full":
                ax.axhline(score, linestyle="--", color="black", linewidth=1, label=f"{r['model']} {r['label']}")
                continue
            if r["budget"] is None:  # a budget given as a ratio has no point on the token axis
                continue
            lines.setdefault(_line_name(r), []).append((r["budget"], score))
        for name, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **styles[name])
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel("score")
        ax.set_title(dataset)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, out / f"{file_name}.png")


def full_kv_frontiers(needle_runs: list[dict], bench_runs: list[dict]) -> dict:
    """Per model, the longest length full KV handled before OOM: from a full-KV needle run's OOM
    cells, else from measured ``eval.bench`` rows; models with neither get no line."""
    frontiers = {}
    for r in bench_runs:
        value = frontier_from_bench(r["rows"])
        if value is not None:
            frontiers[r["model"]] = value
    for r in needle_runs:
        if r["tag"] == "full":
            value = frontier_from_cells(r["cells"])
            if value is not None:
                frontiers[r["model"]] = value
    return frontiers


def needle_report(runs: list[dict], out: Path, frontiers: dict | None = None, kind: str = "needle") -> list[Path]:
    """Heatmaps of every grid run, a side-by-side figure (one colour scale) and mean score per length."""
    paths = []
    summary = []
    frontiers = frontiers or {}
    for r in runs:
        name = file_name(kind, r["name"])
        paths += save_heatmap(r["cells"], out / f"{name}.png", f"{r['model']} · {r['label']}",
                              frontiers.get(r["model"]), r["trained_context"])
        for length in sorted({c["context_length"] for c in r["cells"]}):
            cells = [c for c in r["cells"] if c["context_length"] == length]
            ok = [c["score"] for c in cells if c.get("score") is not None]
            summary.append({"model": r["model"], "setting": r["label"], "context_length": length,
                            "mean_score": round(sum(ok) / len(ok), 3) if ok else None,
                            "oom_cells": len(cells) - len(ok)})
    if len(runs) > 1:
        paths += save_side_by_side([(f"{r['model']} · {r['label']}", r["cells"]) for r in runs],
                                   out / f"{kind}_side_by_side.png", frontiers.get(runs[0]["model"]),
                                   runs[0]["trained_context"])
    if summary:
        with (out / f"{kind}_summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(summary[0]))
            writer.writeheader()
            writer.writerows(summary)
        md = ["| model | setting | context length | mean score | OOM cells |", "|---|---|---|---|---|"]
        md += [f"| {s['model']} | {s['setting']} | {s['context_length']} | "
               f"{'OOM' if s['mean_score'] is None else s['mean_score']} | {s['oom_cells']} |" for s in summary]
        (out / f"{kind}_summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
        paths += [out / f"{kind}_summary.csv", out / f"{kind}_summary.md"]
    return paths


def bench_report(runs: list[dict], out: Path) -> list[Path]:
    paths = []
    for r in runs:
        name = "timing/" + file_name("speed_memory", r["name"].removeprefix("bench_"))
        (out / "timing").mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(bench_markdown(r["rows"]), encoding="utf-8")
        paths.append(out / f"{name}.md")
        paths += bench_figure(r["rows"], out / f"{name}.png", f"{r['model']}: decoding latency")
    return paths


def observe_report(runs: list[dict], out: Path) -> list[Path]:
    """Hit-rate tables and Figures 2 and 3 of every ``eval.observe`` run, named per model and run."""
    from ..observe.summary import figures, tables
    paths = []
    for r in runs:
        o = r["observe"]
        name = file_name("observe", r["name"]) + "_"
        settings = (f"{r['model']}, window {o.get('window')}, p {o.get('p')}, theta {o.get('theta')}, "
                    f"pooling {o.get('pooling')}, question at the {o.get('question_position')}")
        (out / f"{name}hit_rates.md").write_text(tables(r["samples"], settings), encoding="utf-8")
        paths.append(out / f"{name}hit_rates.md")
        paths += figures(r["samples"], out, r["model"], prefix=name)
    return paths
