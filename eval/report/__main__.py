"""python -m eval.report: every run under report.runs into tables and figures (Hydra app)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

import snapkv

from ..hydra_app import run_guarded, task_main
from .collect import bench_runs, longbench_runs, math_runs, needle_runs, observe_runs, ruler_runs
from .figures import bench_report, budget_curves, full_kv_frontiers, needle_report, observe_report
from .leaderboard import write_leaderboard
from .math_tables import write_math_tables
from .ruler import write_ruler_tables
from .table1 import write_tables
from snapkv.errors import InputError


def run(cfg: DictConfig):
    root, out = Path(cfg.report.runs), Path(cfg.report.out)
    if not root.is_dir():
        raise InputError(f"report.runs={root}: no such folder (run a task first, e.g. make demo)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    longbench_rows = longbench_runs(root)
    if longbench_rows:
        written += write_tables(longbench_rows, out, list(snapkv.METHODS))
        written += budget_curves(longbench_rows, out)
    ruler = ruler_runs(root)
    written += write_ruler_tables(ruler, out)
    written += write_leaderboard(ruler, out)
    written += budget_curves(ruler, out, "ruler_budget_curve") if ruler else []
    written += write_math_tables(math_runs(root), out)
    needles, benches = needle_runs(root), bench_runs(root)
    written += needle_report(needles, out, full_kv_frontiers(needles, benches))
    written += needle_report(needle_runs(root, "lines.jsonl"), out, kind="lines")
    written += bench_report(benches, out)
    written += observe_report(observe_runs(root), out)
    if cfg.report.get("label"):
        (out / "README.md").write_text(f"{cfg.report.label}\n", encoding="utf-8")
        written.append(out / "README.md")
    print(f"{len(longbench_rows)} LongBench runs -> {len(written)} files under {out}")
    for path in written:
        print(f"  {path}")
    return written


@task_main("report")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
