"""The memory planner against real processes' peak resident memory (tiny models on the CPU): the benchmark's
measuring worker (``eval.bench.measure``) under its fixed mmap threshold, its probes, and the planner's per-token
terms against what those processes hold. Real measurements in fresh processes take seconds each: marked slow
(``make test`` runs them, ``make test-fast`` does not)."""
import json

import pytest

import snapkv
from conftest import compose
from eval.bench.prefill_memory import slope

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


# two-layer stacks wide enough that a prompt token's bytes (the residual stream, a layer's keys and values) stand
# far above the runtime's noise: an MHA shape and a GQA one, float32 on the CPU, chunks of 512 tokens
SHAPES = {
    "mha": dict(model_type="llama", vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=65536),
    "gqa": dict(model_type="llama", vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=65536),
}
CHUNK = 512
LENGTHS = (4096, 8192)


def shape_worker(shape: str):
    """One measuring process for a shape (``PeakWorker``: each peak above what was resident before it, as a fresh
    process measures it; ``test_one_worker_measures_each_configuration_above_what_was_resident_before_it`` pins
    that), warmed up (``warm_up``), so a check pays one process start and model load, not one per configuration."""
    from omegaconf import OmegaConf
    from eval.bench.measure import PeakWorker
    model = OmegaConf.to_container(compose("bench", ["model=tiny-llama"]).model, resolve=True)
    model.update(name=f"two-layer-{shape}", architecture=SHAPES[shape], prefill_chunk=CHUNK)
    worker = PeakWorker(model, "cpu")
    warm_up(worker)
    return worker


def warm_up(worker) -> None:
    """A first configuration a fresh worker measures carries the runtime's one-time allocations (7-9 MiB here:
    kernel workspaces, thread buffers): a short run pays them before the measured ones."""
    worker.measure({"method": "full", "budget": None, "input_tokens": 256, "batch": 1, "decode_tokens": 2,
                    "repeats": 1, "warmup": False, "compressor": {}})


def planned_and_measured(worker, shape: str, method: str) -> tuple[dict, dict]:
    """Per length, the planner's peak above the weights and the worker's peak above the model, as the bench's
    prefill-memory section takes them (``eval.bench.prefill_memory``: the method once first, then the shorter
    length first)."""
    from eval.bench.prefill_memory import measured_peaks, planned_peaks
    fields = {} if method == "full" else {"budget": 1024, "window": 32}
    compressor = snapkv.build_config(method, **fields) if fields else None
    return (planned_peaks(SHAPES[shape], compressor, LENGTHS, "float32", "sdpa", "cpu", CHUNK),
            measured_peaks(worker, method, fields, LENGTHS))


@pytest.fixture
def one_thread(monkeypatch):
    """The measuring worker on one thread, as ``make test`` runs every test: a kernel run on more threads allocates
    buffers of its own per thread (the runtime's, which the planner does not count; SnapKV's window scoring on two
    threads measured 5% more per prompt token on the MHA shape)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_planners_bytes_per_prompt_token_are_the_measured_ones(shape, one_thread):
    """The issue's bar: the per-token slope of the prefill's peak over two lengths, planned against measured, within
    5% for SnapKV (the paper's method) and full KV, on an MHA and a GQA shape (measured on a 2-core CPU, one thread:
    SnapKV -3.8% and +0.7%, full KV +0.1% and +0.2%), and each peak within 10% (the runtime's own few MiB are not
    planned; measured: within 3.2%)."""
    worker = shape_worker(shape)
    try:
        for method in ("snapkv", "full"):
            planned, measured = planned_and_measured(worker, shape, method)
            assert abs(slope(planned) - slope(measured)) / slope(measured) < 0.05, (method, planned, measured)
            for length in LENGTHS:
                assert abs(planned[length] - measured[length]) / measured[length] < 0.10, (method, length)
    finally:
        worker.close()


@pytest.mark.parametrize("method", ["h2o", "adakv"])
def test_the_planner_follows_a_measured_cpu_peak(method, one_thread):
    """Methods with more of their own beside the prefill: H2O scores every query (one chunk as long as the prompt),
    AdaKV ranks across heads; the slope within 10% and each peak within 10% (measured, one thread: H2O -0.8%, AdaKV
    +6.0%; peaks within 2.8%)."""
    worker = shape_worker("mha")
    try:
        planned, measured = planned_and_measured(worker, "mha", method)
    finally:
        worker.close()
    assert abs(slope(planned) - slope(measured)) / slope(measured) < 0.10, (planned, measured)
    for length in LENGTHS:
        assert abs(planned[length] - measured[length]) / measured[length] < 0.10, (length, planned, measured)


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
    """One process serves every configuration of a run: its first one measures what a fresh process measures (the
    runtime's one-time allocations included), and a long one's tensors are unmapped when freed (the fixed threshold),
    so a short one after it measures what the same short one measured before it; a worker that ended is started
    again, and one killed while measuring gives no row."""
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
        first = worker.measure(spec(512))["peak_above_model_bytes"]
        before_long = worker.measure(spec(512))["peak_above_model_bytes"]
        long = worker.measure(spec(8192))["peak_above_model_bytes"]
        pid = worker.proc.pid
        after_long = worker.measure(spec(512))["peak_above_model_bytes"]
        assert worker.proc.pid == pid                        # the same process
        assert abs(first - fresh) < 0.25 * fresh, (first, fresh)
        assert after_long < long / 4
        assert abs(after_long - before_long) < 0.25 * before_long, (after_long, before_long)
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
