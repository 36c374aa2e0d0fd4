"""Measure one benchmark configuration: prefill time, decode time per token, peak memory, KV bytes.

On CPU each configuration runs in a fresh process (``python -m eval.bench.measure``) so its peak
resident memory is its own; on CUDA ``max_memory_allocated`` after a reset does the same in-process.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import snapkv

from ..runner import Runner, is_oom, kv_cache_bytes, load_model  # noqa: F401 (kv_cache_bytes: re-export)


def _reset_cpu_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the VmHWM high-water mark
    except OSError:
        pass


def _cpu_rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(runner: Runner, spec: dict) -> dict:
    """One row of bench.json for ``spec`` = {method, budget, input_tokens, batch, decode_tokens, repeats, ...}."""
    model = runner.model
    device = runner.device
    compressor = snapkv.build_config(spec.get("run_method", spec["method"]), **spec.get("compressor", {}))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (spec.get("batch", 1), spec["input_tokens"]), generator=gen).to(device)
    row = {"method": spec["method"], "budget": spec.get("budget"), "input_tokens": spec["input_tokens"],
           "batch": spec.get("batch", 1), "prefill_s": None, "decode_s_per_token": None,
           "peak_memory_bytes": None, "kv_cache_bytes": None, "oom": False}
    cuda = device.type == "cuda"
    try:
        if not cuda:
            # before the warm-up: the allocator keeps what a run freed, so a peak taken after a
            # warm-up at the same length would miss most of it
            _reset_cpu_peak()
            base = _cpu_rss("VmRSS")
        if spec.get("warmup", True):  # at the measured length: compression and kernels warm (timings)
            runner.generate(ids, compressor, 2)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        prefill, decode = [], []
        for _ in range(int(spec.get("repeats", 3))):
            out = runner.generate(ids, compressor, int(spec["decode_tokens"]))
            prefill.append(out.prefill_s)
            decode.append(out.decode_s_per_token)
        peak = torch.cuda.max_memory_allocated() if cuda else _cpu_rss("VmHWM")
        row.update(prefill_s=statistics.median(prefill), decode_s_per_token=statistics.median(decode),
                   peak_memory_bytes=int(peak), peak_above_model_bytes=int(peak - base),
                   kv_cache_bytes=out.kv_cache_bytes, cache_lengths=out.cache_lengths)
    except Exception as exc:
        if not is_oom(exc):
            raise
        row["oom"] = True
        if cuda:
            torch.cuda.empty_cache()
    return row


def main() -> int:
    request = json.loads(sys.stdin.read())
    cap = request.get("memory_cap_bytes")
    if cap and str(request.get("device", "")).startswith("cuda"):
        # the frontier's cap, enforced: allocations beyond it raise a real out-of-memory error
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    model, _ = load_model(request["model"], request.get("device"), with_tokenizer=False)
    runner = Runner(model, None, mlp_chunk=request["model"].get("mlp_chunk"))
    print(json.dumps(measure(runner, request["spec"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
