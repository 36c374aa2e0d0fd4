"""Find finished runs under a results folder and read what each task wrote."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..speculation import speculation_options


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
    if decoding_label(cfg):
        label += " · " + decoding_label(cfg)
    return label


def decoding_label(cfg: dict) -> str:
    """How a run decoded, where it speculated (``prompt lookup 10``, ``assisted by NAME (10)``); else empty."""
    options = speculation_options(cfg)
    if options.speculative == "prompt_lookup":
        return f"prompt lookup {options.draft_tokens}" + (f", n-grams {options.ngram}" if options.ngram != 2 else "")
    if options.speculative == "assistant":
        return f"assisted by {options.assistant} ({options.draft_tokens})"
    return ""


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
                     "summary": json.loads(summary.read_text()) if summary.exists() else {},
                     "cost": run_cost(run)})
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
                     "decoding": decoding_label(cfg),
                     "label": run_label(cfg), "name": run_name(root, run), "by_length": by_length,
                     "cost_by_length": {n: run_cost(run, int(n)) for n in by_length},
                     "scores": {f"{n} tokens": v["average"] for n, v in by_length.items()}})
    return runs


def math_runs(root: Path) -> list[dict]:
    """AIME25 / MATH-500 runs (``eval.math``): their ``scores.json`` and cost."""
    runs = []
    for path in sorted(Path(root).rglob("scores.json")):
        run = path.parent
        cfg = _config(run)
        if cfg.get("task") != "math":
            continue
        method, budget = setting_of(cfg.get("compressor", {}))
        runs.append({"run": run, "model": cfg["model"]["name"], "method": method, "budget": budget,
                     "compressor": cfg.get("compressor", {}), "query_aware": cfg.get("query_aware", True),
                     "label": run_label(cfg), "name": run_name(root, run), "scores": json.loads(path.read_text()),
                     "cost": run_cost(run)})
    return runs


# What a run cost: every prediction record carries ``cost`` (absent on older records and on out-of-memory
# ones): prompt_tokens, kv_cache_bytes, full_kv_bytes, masked_kv_bytes (head-adaptive methods and KVzip:
# what kvpress's masked cache holds), kept_tokens, prefill_s, prefill_settings, compress_s, decode_s,
# decode_tokens, decode_passes (newer records), drafted_tokens and accepted_tokens (speculative decoding).
RECORD_FILES = ("pred/*.jsonl", "pred_e/*.jsonl", "pred/*/*.jsonl", "needle.jsonl", "lines.jsonl")
MIB = 2 ** 20
# The cost columns of the Markdown tables and what each CSV column holds.
COST_NOTE = ("the KV cache right after the prefill in MiB and as a share of full KV's (kvpress's masked cache beside "
             "it for head-adaptive methods and KVzip), compression time as a share of the prefill's, decoding ms per "
             "generated token and tokens per second, forward passes per generated token (below 1 where speculative "
             "decoding's drafts were accepted, with the share accepted); blank where a run recorded none.")
COST_COLUMNS = ("KV MiB", "of full KV", "overhead", "ms/token", "tokens/s", "passes/token")
COST_FIELDS = ("kv_mib", "kv_share", "kvpress_kv_mib", "kvpress_kv_share", "compress_overhead",
               "decode_ms_per_token", "decode_tokens_per_s", "passes_per_token", "accepted_share", "cost_items")


def record_files(run: Path, length: int | None = None) -> list[Path]:
    """A run's prediction files (LongBench v1/v2, LongBench-E, RULER, needle, lines); RULER's at one
    ``length`` only when given."""
    run = Path(run)
    if length is not None:
        return sorted((run / "pred" / str(length)).glob("*.jsonl"))
    return sorted({p for pattern in RECORD_FILES for p in run.glob(pattern)})


def cost_summary(records) -> dict | None:
    """The cost of a set of records, each a mean over the records that carry ``cost`` (None when none
    does): ``kv_mib`` (KV cache bytes right after the prefill per item, MiB), ``full_kv_mib``,
    ``kv_share`` (mean bytes over full KV's mean bytes), ``kvpress_kv_mib`` / ``kvpress_kv_share`` (what
    kvpress holds: the masked cache's bytes where recorded, else the cache's own), ``masked`` (some record
    gives a masked size), ``compress_overhead`` (all compression seconds over all prefill seconds),
    ``decode_ms_per_token`` (all decoding seconds over all tokens decoded) and ``decode_tokens_per_s`` (its
    inverse), ``passes_per_token`` (the decoding's forward passes over its tokens, where recorded: below one where
    speculative decoding's drafts were accepted), ``accepted_share`` (accepted drafts over drafted ones, where it
    speculated), ``prefill_s`` and ``compress_s`` per item, ``cost_items``."""
    costs = [r["cost"] for r in records if isinstance(r.get("cost"), dict)]
    if not costs:
        return None

    def total(key, fallback=None):
        values = [c.get(key, c.get(fallback) if fallback else None) for c in costs]
        values = [float(v) for v in values if isinstance(v, (int, float))]
        return (sum(values), len(values)) if values else (None, 0)

    def mean(key, fallback=None):
        value, n = total(key, fallback)
        return None if value is None else value / n

    def ratio(num, den, scale=1.0):
        return None if num is None or not den else scale * num / den

    kv, full, held = mean("kv_cache_bytes"), mean("full_kv_bytes"), mean("masked_kv_bytes", "kv_cache_bytes")
    prefill, compress = total("prefill_s")[0], total("compress_s")[0]
    counted = [c for c in costs if isinstance(c.get("decode_passes"), int) and c.get("decode_tokens")]
    drafted = sum(c.get("drafted_tokens") or 0 for c in costs)
    return {"cost_items": len(costs),
            "kv_mib": ratio(kv, MIB), "full_kv_mib": ratio(full, MIB), "kv_share": ratio(kv, full),
            "kvpress_kv_mib": ratio(held, MIB), "kvpress_kv_share": ratio(held, full),
            "masked": any(isinstance(c.get("masked_kv_bytes"), (int, float)) for c in costs),
            "prompt_tokens": mean("prompt_tokens"), "kept_tokens": mean("kept_tokens"),
            "prefill_s": mean("prefill_s"), "compress_s": mean("compress_s"),
            "compress_overhead": ratio(compress, prefill),
            "decode_ms_per_token": ratio(total("decode_s")[0], total("decode_tokens")[0], 1000.0),
            "decode_tokens_per_s": ratio(total("decode_tokens")[0], total("decode_s")[0]),
            "passes_per_token": ratio(sum(c["decode_passes"] for c in counted),
                                      sum(c["decode_tokens"] for c in counted)) if counted else None,
            "accepted_share": ratio(sum(c.get("accepted_tokens") or 0 for c in costs), drafted) if drafted else None}


def run_cost(run: Path, length: int | None = None) -> dict | None:
    """``cost_summary`` of a run folder's records (RULER: at one ``length`` when given)."""
    from ..jsonl import read_records
    return cost_summary(r for path in record_files(run, length) for r in read_records(path))


def _round(value, digits: int):
    return "" if value is None else round(value, digits)


def cost_fields(cost: dict | None) -> dict:
    """A run's cost as CSV columns (``COST_FIELDS``), blank where the run recorded none."""
    cost = cost or {}
    return {"kv_mib": _round(cost.get("kv_mib"), 3), "kv_share": _round(cost.get("kv_share"), 4),
            "kvpress_kv_mib": _round(cost.get("kvpress_kv_mib"), 3),
            "kvpress_kv_share": _round(cost.get("kvpress_kv_share"), 4),
            "compress_overhead": _round(cost.get("compress_overhead"), 4),
            "decode_ms_per_token": _round(cost.get("decode_ms_per_token"), 3),
            "decode_tokens_per_s": _round(cost.get("decode_tokens_per_s"), 2),
            "passes_per_token": _round(cost.get("passes_per_token"), 3),
            "accepted_share": _round(cost.get("accepted_share"), 4),
            "cost_items": cost.get("cost_items", "")}


def _mib(value) -> str:
    """MiB with a tenth's precision, three significant digits below 10 MiB (a small model's cache)."""
    return "" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def cost_cells(cost: dict | None) -> list[str]:
    """A run's cost as Markdown cells (``COST_COLUMNS``), blank where it recorded none: KV MiB per item
    and its share of full KV's (with what kvpress's masked cache holds beside them, ``45.0 (kvpress
    307.6)``, where recorded), compression overhead as a share of the prefill, decoding ms per token, tokens per
    second, and forward passes per token (with the share of drafts accepted where it speculated)."""
    cost = cost or {}

    def fmt(key, form):
        return "" if cost.get(key) is None else format(cost[key], form)

    mib, share = _mib(cost.get("kv_mib")), fmt("kv_share", ".1%")
    if cost.get("masked"):
        mib += f" (kvpress {_mib(cost.get('kvpress_kv_mib'))})" if mib else ""
        share += f" (kvpress {fmt('kvpress_kv_share', '.1%')})" if share else ""
    passes = fmt("passes_per_token", ".2f")
    if passes and cost.get("accepted_share") is not None:
        passes += f" ({cost['accepted_share']:.0%} accepted)"
    return [mib, share, fmt("compress_overhead", ".1%"), fmt("decode_ms_per_token", ".2f"),
            fmt("decode_tokens_per_s", ".1f"), passes]
