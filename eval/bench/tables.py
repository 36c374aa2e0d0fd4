"""bench.json rows to a Markdown table with full/compressed ratios, and the paper-style figure."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..plotting import save_figure  # noqa: E402


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def _seconds(x):
    return "-" if x is None else f"{x:.3f}"


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def _share(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


def _error(planned, measured) -> str:
    """The planner's relative error against the measurement."""
    return "-" if not planned or not measured or measured <= 0 else f"{(planned - measured) / measured:+.1%}"


def label(row) -> str:
    sized = row["method"] not in ("full", "empty_cache") and row.get("budget") is not None  # ThinK: no budget
    return f"{row['method']}-{row['budget']}" if sized else row["method"]


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | input tokens | method | prefill s | decode ms/token | decode speed-up vs full | "
             "peak MiB | peak above model MiB | planned MiB | planner error | memory saving vs full | KV cache MiB | "
             "planned KV MiB | KV ratio full/this | OOM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    full = {(r["batch"], r["input_tokens"]): r for r in rows if r["method"] == "full"}
    for r in sorted(rows, key=lambda r: (r["batch"], r["input_tokens"], r["method"] != "full", label(r))):
        base = full.get((r["batch"], r["input_tokens"]), {})
        decode = r["decode_s_per_token"]
        lines.append(
            f"| {r['batch']} | {r['input_tokens']} | {label(r)} | "
            f"{_seconds(r['prefill_s'])} | "
            f"{'-' if decode is None else f'{decode * 1000:.1f}'} | {_ratio(base.get('decode_s_per_token'), decode)} | "
            f"{_mib(r['peak_memory_bytes'])} | {_mib(r.get('peak_above_model_bytes'))} | "
            f"{_mib(r.get('predicted_peak_above_model_bytes'))} | "
            f"{_error(r.get('predicted_peak_above_model_bytes'), r.get('peak_above_model_bytes'))} | "
            f"{_ratio(base.get('peak_above_model_bytes'), r.get('peak_above_model_bytes'))} | "
            f"{_mib(r['kv_cache_bytes'])} | {_mib(r.get('predicted_kv_cache_bytes'))} | "
            f"{_ratio(base.get('kv_cache_bytes'), r['kv_cache_bytes'])} | "
            f"{'OOM' if r['oom'] else 'killed' if r.get('killed') else ''} |")
    return "\n".join(lines) + "\n"


def head_adaptive_markdown(rows: list[dict]) -> str:
    """Head-adaptive rows (ragged caches: ``padded_kv_bytes`` recorded) against SnapKV at the same batch,
    input length and budget: what the ragged cache holds, what it would hold padded to its longest head
    and masked as kvpress keeps it, and its decoding time and peak as ratios to SnapKV's (one run)."""
    snap = {(r["batch"], r["input_tokens"], r["budget"]): r for r in rows if r["method"] == "snapkv" and not r["oom"]}
    ours = [r for r in rows if r.get("padded_kv_bytes") and (r["batch"], r["input_tokens"], r["budget"]) in snap]
    if not ours:
        return ""
    lines = ["| batch | input tokens | method | KV MiB | KV / SnapKV | padded to longest head MiB | "
             "masked (kvpress) MiB | decode ms/token | decode / SnapKV | peak above model MiB | peak / SnapKV | "
             "planner error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(ours, key=lambda r: (r["batch"], r["input_tokens"], label(r))):
        base = snap[(r["batch"], r["input_tokens"], r["budget"])]
        lines.append(
            f"| {r['batch']} | {r['input_tokens']} | {label(r)} | {_mib(r['kv_cache_bytes'])} | "
            f"{_share(r['kv_cache_bytes'], base['kv_cache_bytes'])} | {_mib(r['padded_kv_bytes'])} | "
            f"{_mib(r['masked_kv_bytes'])} | {r['decode_s_per_token'] * 1000:.1f} | "
            f"{_share(r['decode_s_per_token'], base['decode_s_per_token'])} | "
            f"{_mib(r.get('peak_above_model_bytes'))} | "
            f"{_share(r.get('peak_above_model_bytes'), base.get('peak_above_model_bytes'))} | "
            f"{_error(r.get('predicted_peak_above_model_bytes'), r.get('peak_above_model_bytes'))} |")
    return ("## Head-adaptive caches against SnapKV\n\nRatios to SnapKV at the same budget (this / SnapKV). "
            "A head-adaptive cache stores each head's own kept positions (ragged); the padded and masked "
            "columns are what the same selection would hold padded to each layer's longest head, and kept whole "
            "with the evicted keys masked (kvpress).\n\n" + "\n".join(lines) + "\n")


def figure(rows: list[dict], path: Path, title: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {}
    for r in rows:
        if r["method"] != "empty_cache":
            series.setdefault((label(r), r["batch"]), []).append(r)
    for (name, batch), items in sorted(series.items()):
        items.sort(key=lambda r: r["input_tokens"])
        ok = [r for r in items if not r["oom"]]
        line, = ax.plot([r["input_tokens"] for r in ok], [r["decode_s_per_token"] * 1000 for r in ok],
                        marker="o", label=f"{name} (batch {batch})")
        for r in items:
            if r["oom"]:
                top = max((q["decode_s_per_token"] * 1000 for q in ok), default=1)
                ax.scatter([r["input_tokens"]], [top], marker="x", color=line.get_color(), s=60)
                ax.annotate("OOM", (r["input_tokens"], top), textcoords="offset points", xytext=(4, 4), fontsize=7)
    floor = [r for r in rows if r["method"] == "empty_cache" and not r["oom"]]
    if floor:
        ax.axhline(floor[0]["decode_s_per_token"] * 1000, color="grey", linestyle=":", label="empty cache (floor)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("Input sequence length (tokens)")
    ax.set_ylabel("Decoding latency (ms/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)
