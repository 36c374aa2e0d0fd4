"""Find finished runs under a results folder and read what each task wrote."""
from __future__ import annotations

import json
from pathlib import Path

import yaml


def _config(run: Path) -> dict:
    path = run / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


def setting_of(compressor: dict) -> tuple[str, int | None]:
    return compressor.get("method", "?"), compressor.get("budget")


def label_of(compressor: dict) -> str:
    """The short label of a run's compressor (``SnapKV 1024 (window 16)``), from the method registry."""
    import snapkv
    fields = {k: v for k, v in compressor.items() if k not in ("method", "tag")}
    try:
        return snapkv.build_config(compressor.get("method", "?"), **fields).label()
    except ValueError:
        return compressor.get("tag", compressor.get("method", "?"))


def run_label(cfg: dict) -> str:
    """A run's label: its compressor's, marked where the question was appended after compression and
    where several items were in flight (``batch.items``)."""
    label = label_of(cfg.get("compressor", {}))
    if not cfg.get("query_aware", True):
        label += " · query-agnostic"
    if (cfg.get("batch") or {}).get("items", 1) != 1:
        label += " · batched"
    return label


def run_name(root: Path, run: Path) -> str:
    """A file-name part unique within one report: the run's folder below the report's root."""
    parts = run.relative_to(root).parts if run != root else (run.name,)
    return "_".join(parts)


def longbench_runs(root: Path) -> list[dict]:
    runs = []
    for result in sorted(Path(root).rglob("result.json")):
        run = result.parent
        cfg = _config(run)
        if cfg.get("task") != "longbench":
            continue
        method, budget = setting_of(cfg.get("compressor", {}))
        summary = run / "summary.json"
        runs.append({"run": run, "model": cfg["model"]["name"], "method": method, "budget": budget,
                     "tag": cfg["compressor"].get("tag", method), "compressor": cfg["compressor"],
                     "label": run_label(cfg), "query_aware": cfg.get("query_aware", True),
                     "name": run_name(root, run),
                     "model_cfg": cfg["model"], "scores": json.loads(result.read_text()),
                     "summary": json.loads(summary.read_text()) if summary.exists() else {}})
    return runs


def needle_runs(root: Path, results: str = "needle.jsonl") -> list[dict]:
    """Grid runs (needle; ``lines.jsonl`` for LongEval-Lines)."""
    from ..jsonl import read_records
    runs = []
    for cells in sorted(Path(root).rglob(results)):
        cfg = _config(cells.parent)
        runs.append({"run": cells.parent, "model": cfg.get("model", {}).get("name", "?"),
                     "tag": cfg.get("compressor", {}).get("tag", "?"), "name": run_name(root, cells.parent),
                     "label": run_label(cfg),
                     "trained_context": cfg.get("model", {}).get("trained_context"), "cells": read_records(cells)})
    return runs


def bench_runs(root: Path) -> list[dict]:
    runs = []
    for path in sorted(Path(root).rglob("bench.json")):
        cfg = _config(path.parent)
        runs.append({"run": path.parent, "model": cfg.get("model", {}).get("name", "?"),
                     "name": run_name(root, path.parent), "rows": json.loads(path.read_text())})
    return runs


def observe_runs(root: Path) -> list[dict]:
    from ..jsonl import read_records
    runs = []
    for path in sorted(Path(root).rglob("hits.jsonl")):
        cfg = _config(path.parent)
        samples = [s for s in read_records(path) if s.get("records")]
        if samples:
            runs.append({"run": path.parent, "model": cfg.get("model", {}).get("name", "?"),
                         "name": run_name(root, path.parent), "observe": cfg.get("observe", {}), "samples": samples})
    return runs


def ruler_runs(root: Path) -> list[dict]:
    """RULER runs: ``scores`` maps each length to its task average (for the budget curve),
    ``by_length`` is the run's ``scores.json``."""
    runs = []
    for path in sorted(Path(root).rglob("scores.json")):
        run = path.parent
        cfg = _config(run)
        if cfg.get("task") != "ruler":
            continue
        by_length = json.loads(path.read_text())
        method, budget = setting_of(cfg.get("compressor", {}))
        runs.append({"run": run, "model": cfg["model"]["name"], "method": method, "budget": budget,
                     "compressor": cfg.get("compressor", {}), "query_aware": cfg.get("query_aware", True),
                     "label": run_label(cfg), "name": run_name(root, run), "by_length": by_length,
                     "scores": {f"{n} tokens": v["average"] for n, v in by_length.items()}})
    return runs
