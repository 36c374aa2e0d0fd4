"""make demo: the whole workflow on the embedded default (SmolLM2-135M on CPU, offline), in minutes.

A budget x pooling sweep on bundled LongBench rows, a needle grid for full KV vs SnapKV vs
StreamingLLM, a small RULER part, the observation-window hit rates, a speed/memory benchmark, then
tables and figures under results/demo/.

    python scripts/demo.py [all|longbench|needle|ruler|observe|bench]

Every part is the task's own Hydra app with the overrides below, run in this one process: the
libraries are imported once and the model is loaded once (``models_kept_loaded``), instead of once per
part. The command each part stands for is printed as it starts.
"""
from __future__ import annotations

import importlib
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = "results/demo-runs"  # not under results/runs: make tables over real runs never sees the demo's
# One job per part: full KV and every compressor setting share one prefill per prompt (full, which
# reads no budget or pooling, is one setting), and the settings decode as one batch (decode_together:
# a token may differ from a solo run where batched arithmetic rounds differently;
# docs/shared_prefill.md says how often it did here).
TOGETHER = ["hydra/sweeper=shared_prefill", "shared_prefill.decode_together=true"]
PARTS = {
    "longbench": ("eval.longbench", ["-m", *TOGETHER, "experiment=demo", "compressor=full,snapkv",
                                     "compressor.budget=256,512", "compressor.pooling=maxpool,avgpool",
                                     f"hydra.sweep.dir={RUNS}/longbench"]),
    "needle": ("eval.needle", ["-m", *TOGETHER, "experiment=demo", "compressor=full,snapkv,streamingllm",
                               "compressor.budget=256", f"hydra.sweep.dir={RUNS}/needle"]),
    # query-aware and not: two jobs (the prefills differ), each sharing its prefill
    "ruler": ("eval.ruler", ["-m", *TOGETHER, "experiment=demo", "compressor=full,snapkv", "compressor.budget=256",
                             "query_aware=true,false", f"hydra.sweep.dir={RUNS}/ruler"]),
    "observe": ("eval.observe", ["experiment=demo", f"hydra.run.dir={RUNS}/observe/smollm2-135m"]),
    "bench": ("eval.bench", ["experiment=demo", f"hydra.run.dir={RUNS}/bench/smollm2-135m"]),
}


def label(command: str) -> str:
    import torch
    return (f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32) on CPU ({torch.get_num_threads()} cores); "
            f"command: {command}")


def run_app(module: str, args: list[str]) -> None:
    """One task app, as ``python -m module args`` runs it."""
    from hydra.core.global_hydra import GlobalHydra
    print(f"$ python -m {module} {shlex.join(args)}", flush=True)
    GlobalHydra.instance().clear()
    argv = sys.argv
    sys.argv = [module, *args]
    try:
        importlib.import_module(f"{module}.__main__").main()
    finally:
        sys.argv = argv


def report(runs: str, out: str, command: str) -> None:
    run_app("eval.report", [f"report.runs={runs}", f"report.out={out}", f"report.label='{label(command)}'"])


def machine_speed() -> str:
    """The machine's float32 matmul rate, so that the times below can be compared with the README's."""
    import torch
    a = torch.randn(2048, 2048)
    a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    rate = 5 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9
    return f"machine: {rate:.0f} GFLOPS float32 matmul on {torch.get_num_threads()} threads"


def main(part: str) -> int:
    if part not in ("all", *PARTS):
        print(f"usage: scripts/demo.sh [all|{'|'.join(PARTS)}] (got {part!r})", file=sys.stderr)
        return 2
    from eval.runner import models_kept_loaded
    print(machine_speed(), flush=True)
    times = []

    def timed(name, fn, *args):
        start = time.perf_counter()
        fn(*args)
        times.append(f"{name} {time.perf_counter() - start:.0f} s")
    with models_kept_loaded():
        for name in PARTS if part == "all" else [part]:
            timed(name, run_app, *PARTS[name])
            if part != "all":
                timed("report", report, f"{RUNS}/{name}", f"results/report/demo-{name}", f"make {name}")
        if part == "all":
            timed("report", report, RUNS, "results/demo", "make demo")
    print(f"time per part: {'; '.join(times)}")
    print(f"demo ({part}) done")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import os
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "all"))
