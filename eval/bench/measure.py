"""Measure one benchmark configuration: prefill time, decode time per token, peak memory, KV bytes.

On CPU the configurations' peak resident memory comes from a worker process under a fixed allocator
setting (``PeakWorker``: ``python -m eval.bench.measure --serve``, one per benchmark run, measuring
them one after another; ``run_worker``: a fresh process for one measurement, as the frontier's
probes), and their timings from the benchmark's process, as users run Python; on CUDA
``max_memory_allocated`` after a reset gives the peak in the same process as the timings.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

import snapkv

from ..runner import Runner, chunking, is_oom, kv_cache_bytes, load_model  # noqa: F401 (kv_cache_bytes: re-export)


# glibc serves large blocks with mmap, but each time one is freed it raises its mmap threshold (up to
# 32 MiB) and keeps later blocks of that size on its heap, where freed memory stays resident: peak
# RSS then counts tensors the program no longer holds (measured on tiny-llama-32l at 16K tokens:
# full KV 1131 MiB instead of 602, SnapKV 346 instead of 123). A fixed threshold turns that
# adjustment off, so resident memory follows the live tensors, as max_memory_allocated does on CUDA.
# It also maps and unmaps every large tensor at each step, which slows decoding with a long cache far
# more than with a short one (SmolLM2 at 6,965 tokens: full KV 0.435 s a token under it, 0.19-0.20
# without), so timings come from a process without it (the benchmark's own).
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
PEAK_FIELDS = ("peak_memory_bytes", "peak_above_model_bytes", "over_cap")
ROW_MARK = "bench-row: "  # a served row's line on the worker's stdout (libraries may print there too)


def run_worker(request: dict, timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """One measurement in a fresh process under ``WORKER_ENV``; ``request`` = {model, device, spec[,
    memory_cap_bytes]}."""
    return subprocess.run([sys.executable, "-m", "eval.bench.measure"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **WORKER_ENV})


class PeakWorker:
    """One process under ``WORKER_ENV`` that loads the model once and measures configurations one
    after another (``python -m eval.bench.measure --serve``). Under the fixed threshold every large
    tensor is unmapped when freed, so resident memory returns to the model and the runtime after each
    configuration, and each peak is counted above the memory resident just before it (``measure``):
    the peak a fresh process per configuration would show, without a process start and a model load
    per configuration."""

    def __init__(self, model_cfg: dict, device: str):
        self.request = {"model": model_cfg, "device": device}
        self.proc: subprocess.Popen | None = None
        self.log = None

    def measure(self, spec: dict) -> dict | None:
        """The worker's row for ``spec``; None when the system killed the worker while measuring it
        (e.g. the host's OOM killer); a later call starts a new one."""
        line = json.dumps({**self.request, "spec": spec}) + "\n"
        for attempt in range(2):
            self._start()
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
                break
            except BrokenPipeError:  # it ended after its last row: once more in a new one
                self._ended()
                if attempt:
                    raise
        for out in self.proc.stdout:
            if out.startswith(ROW_MARK):
                return json.loads(out[len(ROW_MARK):])
        code = self._ended()
        if code in (-9, 137):
            return None
        raise RuntimeError(f"bench worker failed for {spec['method']} at {spec['input_tokens']} tokens "
                           f"(exit {code}):\n{self._log_tail()}")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self._ended()

    def _start(self) -> None:
        if self.proc is None:
            self.log = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen([sys.executable, "-m", "eval.bench.measure", "--serve"], text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                         env={**os.environ, **WORKER_ENV})

    def _ended(self) -> int:
        code = self.proc.wait()
        self.proc = None
        return code

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]


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


def _stop_over_cap(row: dict, base: int, cap: int, interval_s: float = 0.005) -> None:
    """CPU: end the process with an "over the cap" row as soon as resident memory above ``base``
    passes ``cap`` (as an enforced CUDA cap would), instead of running a failing probe to the end."""
    def watch():
        while True:
            used = _cpu_rss("VmRSS") - base
            if used > cap:
                sys.stdout.write(json.dumps({**row, "over_cap": True, "peak_above_model_bytes": used}) + "\n")
                sys.stdout.flush()
                os._exit(0)
            threading.Event().wait(interval_s)
    threading.Thread(target=watch, daemon=True).start()


def measure(runner: Runner, spec: dict, cap_bytes: int | None = None) -> dict:
    """One row of bench.json for ``spec`` = {method, budget, input_tokens, batch, decode_tokens, repeats, ...};
    with ``cap_bytes`` on CPU the process ends early once its memory above the model passes the cap."""
    model = runner.model
    device = runner.device
    compressor = snapkv.build_config(spec.get("run_method", spec["method"]), **spec.get("compressor", {}))
    # the prompt's last tokens stand for its question, for a method reading its length (FINCH's window)
    question = int(spec.get("question_tokens", 0)) if compressor.needs_question_length else 0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (spec.get("batch", 1), spec["input_tokens"]), generator=gen).to(device)
    row = {"method": spec["method"], "budget": spec.get("budget"), "input_tokens": spec["input_tokens"],
           "batch": spec.get("batch", 1), "prefill_s": None, "decode_s_per_token": None,
           "peak_memory_bytes": None, "kv_cache_bytes": None, "oom": False}
    cuda = device.type == "cuda"
    try:
        # the baseline is a model that has run: one token initializes the runtime (thread pools,
        # kernels, the CUDA context's workspaces), which no input length changes
        runner.generate(ids[:, :1], snapkv.FullKV(), 1)
        if not cuda:
            # before the warm-up, so that its peak counts too (it is a run at the measured length)
            _reset_cpu_peak()
            base = _cpu_rss("VmRSS")
            if cap_bytes:
                _stop_over_cap(row, base, cap_bytes)
        repeats = int(spec.get("repeats", 3))
        prefills = min(int(spec.get("prefill_repeats") or repeats), repeats)
        if spec.get("warmup", True) and prefills == repeats:  # at the measured length: compression and
            runner.generate(ids, compressor, 2, question_in_prompt=question)  # kernels warm (timings)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        prefill, decode = [], []
        for i in range(prefills):  # the decodes share the prefills, each from a copy of its cache
            share = repeats // prefills + (i < repeats % prefills)
            runs = runner.decode_repeatedly(ids, compressor, int(spec["decode_tokens"]), share,
                                            question_in_prompt=question)
            prefill.append(runs[0].prefill_s)
            decode.extend(run.decode_s_per_token for run in runs)
            out = runs[-1]
        peak = torch.cuda.max_memory_allocated() if cuda else _cpu_rss("VmHWM")
        row.update(prefill_s=statistics.median(prefill), decode_s_per_token=statistics.median(decode),
                   peak_memory_bytes=int(peak), peak_above_model_bytes=int(peak - base),
                   kv_cache_bytes=out.kv_cache_bytes, cache_lengths=out.cache_lengths, **out.storage_bytes)
    except Exception as exc:
        if not is_oom(exc):
            raise
        row["oom"] = True
        if cuda:
            torch.cuda.empty_cache()
    return row


def serve() -> int:
    """``--serve``: one request per line on stdin (one model for all), one ``ROW_MARK`` line each."""
    runner = None
    for line in sys.stdin:
        request = json.loads(line)
        if runner is None:
            model, _ = load_model(request["model"], request.get("device"), with_tokenizer=False)
            runner = Runner(model, None, **chunking(request["model"]))
        print(ROW_MARK + json.dumps(measure(runner, request["spec"])), flush=True)
    return 0


def main() -> int:
    if "--serve" in sys.argv[1:]:
        return serve()
    request = json.loads(sys.stdin.read())
    cap = request.get("memory_cap_bytes")
    if cap and str(request.get("device", "")).startswith("cuda"):
        # the frontier's cap, enforced: allocations beyond it raise a real out-of-memory error
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    model, _ = load_model(request["model"], request.get("device"), with_tokenizer=False)
    runner = Runner(model, None, **chunking(request["model"]))
    cpu_cap = None if str(request.get("device", "")).startswith("cuda") else cap
    print(json.dumps(measure(runner, request["spec"], cpu_cap)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
