"""``needle.dry_run=true``: the grid, what is done, and which lengths the memory planner says fit,
before any weights are loaded."""
from __future__ import annotations

from pathlib import Path

from snapkv.memory import plan

from ..jsonl import write_json_atomic


def device_memory_bytes(cfg, device: str) -> tuple[int, str]:
    if cfg.needle.get("memory_gib") is not None:
        return int(float(cfg.needle.memory_gib) * 2**30), "needle.memory_gib"
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    import psutil
    return psutil.virtual_memory().total, "host memory"


def dry_run(cfg, compressor, lengths, depths, done: set, out: Path, device: str) -> dict:
    from ..runner import chunking, model_architecture
    arch = model_architecture(cfg.model)
    memory, where = device_memory_bytes(cfg, device)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    per_length = []
    for length in lengths:
        p = plan(arch, length, compressor if compressor.compresses else None, dtype=dtype,
                 attn_implementation=cfg.model.get("attn_implementation", "sdpa"),
                 **chunking(cfg.model), decode_tokens=int(cfg.needle.max_new_tokens), device=device)
        per_length.append({"context_length": length, "predicted_peak_bytes": p["peak_bytes"],
                           "fits": p["peak_bytes"] <= memory,
                           "cells_done": sum(1 for d in depths if (length, d) in done)})
    summary = {"model": cfg.model.name, "compressor": compressor.describe(), "lengths": lengths, "depths": depths,
               "cells": len(lengths) * len(depths), "cells_done": len(done & {(n, d) for n in lengths for d in depths}),
               "memory_bytes": memory, "memory_source": where, "per_length": per_length}
    write_json_atomic(out / "plan.json", summary)
    fitting = [r["context_length"] for r in per_length if r["fits"]]
    print(f"needle dry run: {cfg.model.name}, {compressor.method}, {len(lengths)} lengths x {len(depths)} depths = "
          f"{summary['cells']} cells, {summary['cells_done']} done, {summary['cells'] - summary['cells_done']} to run")
    print(f"  memory: {memory / 2**30:.1f} GiB ({where}); planner: {len(fitting)} of {len(lengths)} lengths fit"
          + (f", longest {max(fitting)} tokens" if fitting else ""))
    for r in per_length:
        print(f"  {r['context_length']:>8} tokens: peak {r['predicted_peak_bytes'] / 2**30:8.2f} GiB "
              f"{'fits' if r['fits'] else 'OOM'}  ({r['cells_done']}/{len(depths)} done)")
    print(f"  -> {out / 'plan.json'}")
    return summary
