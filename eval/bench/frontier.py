"""The memory frontier, measured: the longest input each method handles under a memory cap.

Bisection over input length, each probe a fresh process (``python -m eval.bench.measure``): from
0.9 x the planner's frontier the length grows (or shrinks) by 1.2x until the frontier is bracketed
(``frontier_start=min``: from ``frontier_min``, doubling), then the bracket halves until it is
within ``frontier_resolution`` (2%). On CUDA the cap is enforced (``set_per_process_memory_fraction``
of ``bench.memory_gib``), so a failure is a real OOM; on CPU a probe fits when its measured peak
resident memory above the loaded model stays under the cap. A probe killed by the system is
"killed", one past ``probe_timeout_s`` "timeout"; both count as not fitting and are recorded as
such, never as OOM. The planner's predicted frontier stands beside each measured one.
"""
from __future__ import annotations

import subprocess

import snapkv
from snapkv.memory import longest_fitting, plan

from ..jsonl import append_record, read_records

FRONTIER_STARTS = ("planner", "min")  # bench.frontier_start: 0.9x the planner's frontier, or frontier_min


def probe(model_cfg: dict, device: str, spec: dict, cap_bytes: int, timeout_s: float) -> dict:
    import json
    from .measure import run_worker
    request = {"model": model_cfg, "device": device, "spec": spec, "memory_cap_bytes": cap_bytes}
    base = {k: spec[k] for k in ("method", "budget", "input_tokens", "batch")}
    try:
        proc = run_worker(request, timeout_s)
    except subprocess.TimeoutExpired:
        return {**base, "fits": False, "outcome": "timeout"}
    if proc.returncode in (-9, 137):
        return {**base, "fits": False, "outcome": "killed"}
    if proc.returncode != 0:
        raise RuntimeError(f"frontier probe failed for {spec['method']} at {spec['input_tokens']} tokens:\n"
                           f"{proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if row["oom"]:
        return {**base, "fits": False, "outcome": "oom"}
    peak = row["peak_above_model_bytes"] if device == "cpu" else row["peak_memory_bytes"]
    if row.get("over_cap"):  # CPU: stopped the moment it passed the cap
        return {**base, "fits": False, "outcome": "over the cap", "peak_bytes": peak, "stopped_early": True}
    fits = peak <= cap_bytes
    return {**base, "fits": fits, "outcome": "fits" if fits else "over the cap", "peak_bytes": peak}


def _probe_key(row: dict) -> tuple:
    return row["method"], row.get("budget"), row["batch"], row["input_tokens"]


def _name(row: dict) -> str:
    return row["method"] if row["method"] == "full" else f"{row['method']}-{row['budget']}"


def bisect(run_probe, start: int, stop: int, resolution: float, growth: float = 2.0,
           floor: int | None = None) -> tuple[int | None, list[dict]]:
    """The longest fitting length in [floor, stop] to ``resolution``, and every probe made: from
    ``start`` the length grows (or, if ``start`` does not fit, shrinks) by ``growth`` until the
    frontier is bracketed, then the bracket halves."""
    probes = []
    def fits(n):
        row = run_probe(n)
        probes.append(row)
        return row["fits"]
    floor = start if floor is None else min(floor, start)
    lo = hi = None
    if fits(start):
        lo = start
    else:
        hi = start
        while lo is None:
            n = max(floor, min(hi - 1, int(hi / growth)))
            if n >= hi:
                return None, probes
            if fits(n):
                lo = n
            elif n == floor:
                return None, probes
            else:
                hi = n
    while hi is None:
        n = min(max(lo + 1, int(lo * growth)), stop)
        if n == lo:
            return lo, probes
        if fits(n):
            lo = n
        else:
            hi = n
    while (hi - lo) / lo > resolution:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def planned_frontier(arch: dict, compressor, cap_bytes: int, batch: int, cfg, device: str) -> int:
    from ..runner import chunking
    kwargs = dict(batch=batch, dtype=str(cfg.model.dtype), attn_implementation=cfg.model.get("attn_implementation",
                  "sdpa"), **chunking(cfg.model), decode_tokens=int(cfg.bench.decode_tokens))
    weights = plan(arch, 1, None, **kwargs)["weights_bytes"]
    memory = cap_bytes + (weights if device == "cpu" else 0)
    return longest_fitting(arch, memory, compressor, **kwargs)


def run_frontier(cfg, out, model_cfg: dict, device: str, specs: list[dict]) -> list[dict]:
    """Rows ``{method, budget, batch, measured_frontier_tokens, planned_frontier_tokens, ...}``."""
    from ..runner import model_architecture
    bench_cfg = cfg.bench
    cap = int(float(bench_cfg.memory_gib) * 2**30)
    arch = model_architecture(cfg.model)
    results = out / "frontier.jsonl"
    done = {(r["method"], r.get("budget"), r["batch"]): r for r in read_records(results, repair=True)}
    # every probe as it ends: an interrupted search resumes without repeating one
    probe_log = out / "frontier_probes.jsonl"
    probed = {_probe_key(r): r for r in read_records(probe_log, repair=True)}
    rows = []
    for spec in specs:
        key = (spec["method"], spec["budget"], spec["batch"])
        compressor = None if spec["method"] == "full" else snapkv.build_config(spec["method"], **spec["compressor"])
        # the planner's frontier is computed anew each time (it is code; the measurement is data)
        planned = planned_frontier(arch, compressor, cap, spec["batch"], cfg, device)
        if key in done:
            rows.append({**done[key], "planned_frontier_tokens": planned})
            continue
        def run_probe(n, spec=spec):
            known = probed.get(_probe_key({**spec, "input_tokens": n}))
            if known is not None:
                return known
            # memory only: one run, no warm-up (the peak is that of the run itself)
            row = probe(model_cfg, device, {**spec, "input_tokens": n, "repeats": 1, "warmup": False}, cap,
                        float(bench_cfg.probe_timeout_s))
            append_record(probe_log, row)
            peak = f", {row['peak_bytes'] / 2**20:.0f} MiB" if row.get("peak_bytes") is not None else ""
            print(f"frontier {_name(spec)} batch {spec['batch']}: {n} tokens -> {row['outcome']}{peak}", flush=True)
            return row
        if bench_cfg.frontier_start == "planner" and planned:
            # the planner's frontier (within 10% of measurement, docs/bench.md) brackets the search in a few probes
            start, growth = max(int(bench_cfg.frontier_min), int(planned * 0.9)), 1.2
        else:
            start, growth = int(bench_cfg.frontier_min), 2.0
        measured, probes = bisect(run_probe, start, int(bench_cfg.frontier_max),
                                  float(bench_cfg.frontier_resolution), growth, int(bench_cfg.frontier_min))
        row = {"method": spec["method"], "budget": spec["budget"], "batch": spec["batch"],
               "memory_cap_bytes": cap, "measured_frontier_tokens": measured, "planned_frontier_tokens": planned,
               "probes": probes}
        append_record(results, row)
        rows.append(row)
    for row in rows:
        full = next((r for r in rows if r["method"] == "full" and r["batch"] == row["batch"]), None)
        base = full and full["measured_frontier_tokens"]
        row["ratio_to_full"] = round(row["measured_frontier_tokens"] / base, 2) if base and row[
            "measured_frontier_tokens"] else None
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", "", "| batch | method | measured frontier (tokens) | planner's frontier | planner error | "
             "ratio to full KV | probes |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["method"] != "full", r["method"], r["budget"] or 0)):
        name = _name(r)
        m, p = r["measured_frontier_tokens"], r["planned_frontier_tokens"]
        error = f"{(p - m) / m:+.1%}" if m and p is not None else "-"
        ratio = f"{r['ratio_to_full']:.2f}x" if r.get("ratio_to_full") else "-"
        lines.append(f"| {r['batch']} | {name} | {m if m is not None else 'none fits'} | {p} | {error} | {ratio} | "
                     f"{len(r['probes'])} |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ..plotting import save_figure
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    batches = sorted({r["batch"] for r in rows})
    names = sorted({(r["method"] != "full", r["method"], r["budget"] or 0) for r in rows})
    width = 0.8 / max(len(batches), 1)
    for i, batch in enumerate(batches):
        values = []
        for _, method, budget in names:
            r = next((r for r in rows
                      if r["method"] == method and (r["budget"] or 0) == budget and r["batch"] == batch),
                     None)
            values.append((r or {}).get("measured_frontier_tokens") or 0)
        ax.bar([j + i * width for j in range(len(names))], values, width=width, label=f"batch {batch}")
    ax.set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(names))],
                  [m if m == "full" else f"{m}-{b}" for _, m, b in names], fontsize=8)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("longest input that fits (tokens)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)
