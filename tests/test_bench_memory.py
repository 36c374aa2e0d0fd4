"""The memory planner against real processes' peak resident memory (tiny models on the CPU): the benchmark's
measuring worker (``eval.bench.measure``) under its fixed mmap threshold, its probes, and the planner's per-token
terms against what those processes hold. Real measurements in fresh processes take seconds each: marked slow
(``make test`` runs them, ``make test-fast`` does not)."""
import json

import pytest

import snapkv
from conftest import compose
from snapkv.memory import plan

pytestmark = pytest.mark.slow


def test_a_real_probe_runs_in_a_fresh_process():
    from omegaconf import OmegaConf
    from eval.bench.frontier import probe
    model = OmegaConf.to_container(compose("bench", ["model=tiny-llama"]).model, resolve=True)
    spec = {"method": "full", "budget": None, "input_tokens": 256, "batch": 1, "decode_tokens": 2, "repeats": 1,
            "compressor": {}}
    row = probe(model, "cpu", spec, 2**30, 300)
    assert row["fits"] and row["outcome"] == "fits" and row["peak_bytes"] < 2**30


def test_a_cpu_probe_stops_as_soon_as_it_passes_the_cap():
    from omegaconf import OmegaConf
    from eval.bench.frontier import probe
    model = OmegaConf.to_container(compose("bench", ["model=tiny-llama-32l"]).model, resolve=True)
    spec = {"method": "full", "budget": None, "input_tokens": 8192, "batch": 1, "decode_tokens": 2, "repeats": 1,
            "warmup": False, "compressor": {}}
    cap = 16 * 2**20   # the KV alone is 256 MiB: the run passes the cap early in its prefill
    row = probe(model, "cpu", spec, cap, 300)
    assert row["outcome"] == "over the cap" and row["stopped_early"] and not row["fits"]
    assert cap < row["peak_bytes"] < 128 * 2**20


@pytest.fixture
def peak_worker():
    """One measuring process for a method's lengths (``PeakWorker``: each peak above what was resident before it,
    as a fresh process measures it; ``test_one_worker_measures_each_configuration_above_what_was_resident_before_it``
    pins that), so a check pays one process start and model load, not one per configuration; the shorter length
    first, in the fresh process, as what a longer run leaves behind adds a few MiB to a shorter one's peak."""
    from omegaconf import OmegaConf
    from eval.bench.measure import PeakWorker
    worker = PeakWorker(OmegaConf.to_container(compose("bench", ["model=tiny-llama-32l"]).model, resolve=True), "cpu")
    yield worker
    worker.close()


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o", "adakv"])
def test_the_planner_follows_a_measured_cpu_peak(method, peak_worker):
    """The planner against the peak resident memory above the model (tiny-llama-32l) of a measuring worker: its
    fixed mmap threshold makes resident memory follow live tensors (with glibc's default, full KV measured 254 MiB
    here against 157). The runtime's own buffers (thread pools, kernel workspaces) are not planned and are 6-10 MiB
    here whatever the length, as much as 15% of this small model's peak; so the growth of the peak from 2048 to
    8192 tokens is held to 15% and the peak itself to 25%. Measured on a 2-core CPU: growth within 3-6%, peaks
    4-18% under."""
    from eval.runner import model_architecture
    cfg = compose("bench", ["model=tiny-llama-32l"])
    fields = {} if method == "full" else {"budget": 1024, "window": 32}
    compressor = snapkv.build_config(method, **fields) if fields else None
    planned, measured = {}, {}
    for length in (2048, 8192):
        spec = {"method": method, "budget": fields.get("budget"), "input_tokens": length, "batch": 1,
                "decode_tokens": 4, "repeats": 1, "warmup": False, "compressor": fields}
        planned[length] = plan(model_architecture(cfg.model), length, compressor, dtype="float32",
                               decode_tokens=4, device="cpu")["peak_above_weights_bytes"]
        peaks = []
        for _ in range(2):  # allocator noise only adds (a busy machine's extra arenas): keep the lower of two
            peaks.append(peak_worker.measure(spec)["peak_above_model_bytes"])
            if abs(planned[length] - min(peaks)) / min(peaks) < 0.1:
                break
        measured[length] = min(peaks)
    growth_planned, growth_measured = planned[8192] - planned[2048], measured[8192] - measured[2048]
    assert abs(growth_planned - growth_measured) / growth_measured < 0.15, (planned, measured)
    for length in planned:
        assert abs(planned[length] - measured[length]) / measured[length] < 0.25, (length, planned, measured)


def test_cpu_peaks_come_from_the_worker_and_timings_from_this_process(monkeypatch):
    """The fixed mmap threshold makes peaks honest but slows decoding with a long cache, so on CPU a
    configuration's peak comes from the worker under WORKER_ENV (one run, no warm-up) and its timings
    from the benchmark's own process."""
    from omegaconf import OmegaConf
    from eval.bench.measure import PeakWorker
    from eval.bench.__main__ import _run_fresh
    seen = []
    real = PeakWorker.measure

    def spy(self, spec):
        seen.append((spec["repeats"], spec["warmup"]))
        return real(self, spec)
    monkeypatch.setattr(PeakWorker, "measure", spy)
    model = OmegaConf.to_container(compose("bench", ["model=tiny-llama"]).model, resolve=True)
    spec = {"method": "full", "budget": None, "input_tokens": 64, "batch": 1, "decode_tokens": 2, "repeats": 3,
            "compressor": {}}
    timings = {"method": "full", "prefill_s": 2.0, "decode_s_per_token": 0.5, "peak_memory_bytes": 1,
               "peak_above_model_bytes": 1, "oom": False}
    worker = PeakWorker(model, "cpu")
    try:
        row = _run_fresh(worker, spec, lambda s: dict(timings, repeats=s["repeats"]))
    finally:
        worker.close()
    assert seen == [(1, False)]
    assert (row["prefill_s"], row["decode_s_per_token"], row["repeats"]) == (2.0, 0.5, 3)
    assert row["peak_above_model_bytes"] > 1000 and row["peak_memory_bytes"] > 1000   # the worker's


def test_one_worker_measures_each_configuration_above_what_was_resident_before_it():
    """One process serves every configuration of a run: a long one's tensors are unmapped when freed
    (the fixed threshold), so a short one after it measures what a fresh process measures; a worker
    that ended is started again, and one killed while measuring gives no row."""
    import os
    import signal
    import threading
    from omegaconf import OmegaConf
    from eval.bench.measure import PeakWorker, run_worker
    model = OmegaConf.to_container(compose("bench", ["model=tiny-llama-32l"]).model, resolve=True)

    def spec(tokens):
        return {"method": "full", "budget": None, "input_tokens": tokens, "batch": 1, "decode_tokens": 2,
                "repeats": 1, "warmup": False, "compressor": {}}
    fresh = json.loads(run_worker({"model": model, "device": "cpu", "spec": spec(512)}, 600)
                       .stdout.strip().splitlines()[-1])["peak_above_model_bytes"]
    worker = PeakWorker(model, "cpu")
    try:
        long = worker.measure(spec(8192))["peak_above_model_bytes"]
        pid = worker.proc.pid
        after_long = worker.measure(spec(512))["peak_above_model_bytes"]
        assert worker.proc.pid == pid                        # the same process
        assert after_long < long / 4
        assert abs(after_long - fresh) < 0.25 * fresh, (after_long, fresh)
        worker.proc.kill()                                   # it ends between two configurations
        worker.proc.wait()
        assert worker.measure(spec(512))["peak_above_model_bytes"] > 0
        assert worker.proc.pid != pid
        worker.close()
        worker._start()                                      # killed while it measures (still importing)
        threading.Timer(0.5, os.kill, (worker.proc.pid, signal.SIGKILL)).start()
        assert worker.measure(spec(512)) is None and worker.proc is None
    finally:
        worker.close()
