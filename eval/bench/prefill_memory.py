"""``bench.prefill_memory.enabled``: how close a compressing prefill comes to the physical limit.

Per method, for the chunked prefill (``model.prefill_chunk``, ``snapkv.prefill``) and the model's own one-pass
prefill (``prefill_chunk=None``):

- **bytes per prompt token**: the slope of the prefill's measured peak between two lengths (CPU: resident memory of
  a worker process under a fixed allocator setting, each peak after a warm-up run of the method; CUDA:
  ``max_memory_allocated``), beside the planner's slope (``snapkv.memory.plan``) and its error;
- the **floor** a compressing prefill cannot go below (the residual stream and one layer's full keys and values)
  and the **layer-wise minimum** a prefill that compresses each layer after a whole-sequence attention holds (the
  floor plus that layer's attention output and its float32 log-sum-exp), and the measured slope's ratio to it;
- the prefill's **time**, chunked over one pass, at ``time_lengths`` (medians of ``repeats``, alternating);
- the **longest input planned** per method on each of ``memory_gib`` (the paper's model by default, ``plan_model``),
  and its planned peaks at ``plan_lengths``.

Every ratio comes from one run on one machine; ``docs/bench.md`` explains the terms.
"""
from __future__ import annotations

import statistics

import torch
from omegaconf import OmegaConf

import snapkv
from snapkv.memory import DTYPE_BYTES, Shape, longest_fitting, plan
from snapkv.prefill import PREFILL_CHUNK

GIB = 2**30
LONGEST = 2**24  # the longest input a plan searches (16M tokens)


def setting(method: str, budget: int):
    return None if method == "full" else snapkv.build_config(method, budget=budget)


def floor_bytes(shape: Shape, nbytes: int) -> int:
    """Per prompt token: the residual stream and one layer's keys and values."""
    return (shape.hidden + 2 * shape.kv_heads * shape.head_dim) * nbytes


def layerwise_minimum_bytes(shape: Shape, nbytes: int) -> int:
    """Per prompt token: the floor, one layer's attention output and its float32 log-sum-exp per head."""
    return floor_bytes(shape, nbytes) + shape.heads * shape.head_dim * nbytes + shape.heads * 4


def slope(peaks: dict) -> float:
    """Bytes per token between the shortest and the longest length of ``{length: bytes}``."""
    (short, low), (long, high) = min(peaks.items()), max(peaks.items())
    return (high - low) / (long - short)


def measured_peaks(worker, method: str, fields: dict, lengths) -> dict:
    """``{length: peak above the model}`` from a ``PeakWorker``, after one run of the method at half the shortest
    length (the method's own one-time allocations: kernel workspaces, thread buffers), shortest first."""
    peaks = {}
    for length in (min(lengths) // 2, *sorted(lengths)):
        spec = {"method": method, "budget": fields.get("budget"), "input_tokens": length, "batch": 1,
                "decode_tokens": 2, "repeats": 1, "warmup": False, "compressor": fields}
        peaks[length] = worker.measure(spec)["peak_above_model_bytes"]
    del peaks[min(lengths) // 2]
    return peaks


def planned_peaks(arch, compressor, lengths, dtype: str, attn: str, device: str, chunk, mlp_chunk=None) -> dict:
    return {length: plan(arch, length, compressor, dtype=dtype, attn_implementation=attn, decode_tokens=2,
                         device=device, prefill_chunk=chunk, mlp_chunk=mlp_chunk)["peak_above_weights_bytes"]
            for length in lengths}


def memory_rows(model_cfg: dict, arch: dict, node, device: str) -> list[dict]:
    """Per method and prefill (chunked, one pass): measured and planned bytes per prompt token."""
    from .measure import PeakWorker
    dtype, attn = str(model_cfg.get("dtype") or "float32"), str(model_cfg.get("attn_implementation") or "sdpa")
    shape, nbytes = Shape.of(arch, device), DTYPE_BYTES[dtype]
    lengths = [int(n) for n in node.lengths]
    rows = []
    for chunk in (model_cfg.get("prefill_chunk"), None):
        worker = PeakWorker({**model_cfg, "prefill_chunk": chunk}, device)
        try:
            for method in node.methods:
                fields = {} if method == "full" else {"budget": int(node.budget)}
                measured = measured_peaks(worker, str(method), fields, lengths)
                planned = planned_peaks(arch, setting(str(method), int(node.budget)), lengths, dtype, attn, device,
                                        chunk, model_cfg.get("mlp_chunk"))
                rows.append({"method": str(method), "prefill_chunk": chunk, "lengths": lengths,
                             "measured_peaks": measured, "planned_peaks": planned,
                             "measured_bytes_per_token": slope(measured), "planned_bytes_per_token": slope(planned),
                             "planner_error": slope(planned) / slope(measured) - 1,
                             "floor_bytes_per_token": floor_bytes(shape, nbytes),
                             "layerwise_minimum_bytes_per_token": layerwise_minimum_bytes(shape, nbytes),
                             "ratio_to_layerwise_minimum": slope(measured) / layerwise_minimum_bytes(shape, nbytes),
                             "ratio_to_floor": slope(measured) / floor_bytes(shape, nbytes)})
        finally:
            worker.close()
    return rows


def time_rows(model, node, chunk: int) -> list[dict]:
    """The prefill's seconds, in chunks of ``chunk`` and in one pass, at each of ``time_lengths`` (medians of
    ``repeats``, the two alternating)."""
    from ..runner import Runner
    runners = {"chunked": Runner(model, prefill_chunk=chunk), "one_pass": Runner(model, prefill_chunk=None)}
    rows = []
    for length in node.time_lengths:
        ids = torch.randint(3, model.config.vocab_size, (1, int(length)), generator=torch.Generator().manual_seed(0))
        ids = ids.to(next(model.parameters()).device)
        for method in node.methods:
            compressor = setting(str(method), int(node.budget)) or snapkv.FullKV()
            seconds = {name: [] for name in runners}
            for _ in range(int(node.repeats)):
                for name, runner in runners.items():
                    seconds[name].append(runner.generate(ids, compressor, 1).prefill_s)
            chunked, one_pass = statistics.median(seconds["chunked"]), statistics.median(seconds["one_pass"])
            rows.append({"method": str(method), "input_tokens": int(length), "chunked_s": chunked,
                         "one_pass_s": one_pass, "time_ratio": chunked / one_pass})
    return rows


def plan_rows(node) -> dict:
    """The longest input planned per method on each memory size, and the planned peaks at ``plan_lengths``, for
    ``plan_model`` (its config's architecture, dtype and attention)."""
    from ..runner import model_config
    model = model_config(node.plan_model, "bench.prefill_memory.plan_model")
    arch = OmegaConf.to_container(model.architecture, resolve=True)
    dtype, attn = str(model.dtype), str(model.attn_implementation)
    out = {"model": str(node.plan_model), "dtype": dtype, "attn_implementation": attn, "longest": [], "peaks": []}
    for method in ["full", *[m for m in node.methods if m != "full"]]:
        compressor = setting(str(method), int(node.budget))
        for chunk in (PREFILL_CHUNK, None):
            kw = dict(dtype=dtype, attn_implementation=attn, prefill_chunk=chunk, mlp_chunk=model.get("mlp_chunk"))
            out["longest"].append({"method": str(method), "prefill_chunk": chunk, **{
                f"{gib}": longest_fitting(arch, int(gib) * GIB, compressor, limit=LONGEST, **kw)
                for gib in node.memory_gib}})
            out["peaks"].append({"method": str(method), "prefill_chunk": chunk, **{
                f"{length}": plan(arch, int(length), compressor, **kw)["peak_bytes"] / GIB
                for length in node.plan_lengths}})
    return out


def markdown(result: dict) -> str:
    lines = [f"# Prefill memory: {result['model']} ({result['dtype']}, {result['attn_implementation']}) on "
             f"{result['device']}", ""]
    if result.get("memory"):
        first = result["memory"][0]
        lines += [f"Bytes per prompt token, the slope of the peak between {first['lengths'][0]:,} and "
                  f"{first['lengths'][-1]:,} tokens; floor (residual stream + one layer's K and V) "
                  f"{first['floor_bytes_per_token']:,} B, layer-wise minimum (+ attention output and log-sum-exp) "
                  f"{first['layerwise_minimum_bytes_per_token']:,} B.", "",
                  "| method | prefill | measured B/token | x layer-wise minimum | x floor | planned B/token | "
                  "planner error |", "|---|---|---|---|---|---|---|"]
        for row in result["memory"]:
            prefill = f"chunks of {row['prefill_chunk']}" if row["prefill_chunk"] else "one pass"
            lines.append(f"| {row['method']} | {prefill} | {row['measured_bytes_per_token']:,.0f} | "
                         f"{row['ratio_to_layerwise_minimum']:.2f} | {row['ratio_to_floor']:.2f} | "
                         f"{row['planned_bytes_per_token']:,.0f} | {row['planner_error']:+.1%} |")
        lines.append("")
    if result.get("time"):
        lines += ["| method | input tokens | chunked s | one pass s | chunked / one pass |", "|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['input_tokens']:,} | {r['chunked_s']:.2f} | {r['one_pass_s']:.2f} | "
                  f"{r['time_ratio']:.3f} |" for r in result["time"]]
        lines.append("")
    planned = result.get("plan")
    if planned:
        sizes = [key for key in planned["longest"][0] if key not in ("method", "prefill_chunk")]
        lines += [f"Longest input planned, {planned['model']} ({planned['dtype']}, {planned['attn_implementation']}):",
                  "", "| method | prefill | " + " | ".join(f"{s} GiB" for s in sizes) + " |",
                  "|---|---|" + "---|" * len(sizes)]
        for row in planned["longest"]:
            prefill = f"chunks of {row['prefill_chunk']}" if row["prefill_chunk"] else "one pass"
            lines.append(f"| {row['method']} | {prefill} | " + " | ".join(f"{row[s]:,}" for s in sizes) + " |")
        lengths = [key for key in planned["peaks"][0] if key not in ("method", "prefill_chunk")]
        lines += ["", "| method | prefill | " + " | ".join(f"{int(n):,} tokens" for n in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for row in planned["peaks"]:
            prefill = f"chunks of {row['prefill_chunk']}" if row["prefill_chunk"] else "one pass"
            lines.append(f"| {row['method']} | {prefill} | " + " | ".join(f"{row[n]:.1f} GiB" for n in lengths) + " |")
    return "\n".join(lines) + "\n"
