"""The SLURM memory request of a shared-prefill job follows the planner (no SLURM needed)."""
import math
from types import SimpleNamespace

import pytest

import snapkv
from conftest import compose
from eval.job_memory import RUNTIME_GIB, SAFETY, array_mem_gb, group_request, job_memory, offline_architecture
from eval.sweep_groups import group_jobs
from snapkv.errors import InputError
from snapkv.memory import plan_shared

SETTINGS = [snapkv.FullKV(), snapkv.SnapKV(budget=64, window=8), snapkv.H2O(budget=64, window=8)]
CPU = {"mem_gb": 2, "gpus_per_node": 0}


def needle_cfg(*extra):
    return compose("needle", ["model=tiny-llama", "needle.lengths=[300,600]", "needle.max_new_tokens=8", *extra])


def planned_gib(cfg, length, new_tokens, settings=SETTINGS):
    arch = offline_architecture(cfg.model)
    return plan_shared(arch, length, settings, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                       mlp_chunk=cfg.model.mlp_chunk, decode_tokens=new_tokens)["peak_bytes"] / 2**30


def test_a_cpu_job_asks_for_its_planned_peak_with_the_configured_value_as_a_floor():
    cfg = needle_cfg()
    needed = math.ceil(planned_gib(cfg, 600, 8) * SAFETY + RUNTIME_GIB)
    assert job_memory(cfg, SETTINGS, CPU).mem_gb == needed > 2           # the longest grid length, every setting
    assert job_memory(cfg, SETTINGS, {**CPU, "mem_gb": 64}).mem_gb == 64  # never below the configured value
    assert job_memory(cfg, SETTINGS, {"gpus_per_node": 0}).mem_gb == needed
    big = compose("longbench", ["model=lwm-1m", "model.max_length=200000", "device=cpu", "longbench.datasets=[qasper]"])
    request = job_memory(big, SETTINGS[:2], {"mem_gb": 64, "gpus_per_node": 1})  # device=cpu: host memory
    assert request.mem_gb == math.ceil(planned_gib(big, 200000, 128, SETTINGS[:2]) * SAFETY + RUNTIME_GIB) > 64
    assert "at 200000 tokens" in request.line and f"mem_gb={request.mem_gb}" in request.line


def test_a_gpu_job_keeps_its_request_and_is_refused_when_it_cannot_fit():
    cfg = compose("needle", ["model=lwm-1m", "needle.lengths=[380000]", "compressor=snapkv_needle"])
    gpu = {"mem_gb": 64, "gpus_per_node": 1}
    full, snap = snapkv.FullKV(), snapkv.SnapKV(budget=1024, window=16, kernel=5, gqa="repeat")
    request = job_memory(cfg, [snap], gpu)
    assert request.mem_gb == 64 and "planned GPU peak" in request.line
    assert "of 80 GiB" in job_memory(cfg, [snap], gpu, gpu_memory_gib=80).line
    with pytest.raises(InputError, match=r"hydra.sweeper.gpu_memory_gib=80: lwm-1m, 2 setting\(s\) plans a GPU peak"):
        job_memory(cfg, [full, snap], gpu, gpu_memory_gib=80)
    assert job_memory(cfg, [full, snap], {**gpu, "gpus_per_node": 4}, gpu_memory_gib=80).mem_gb == 64
    with pytest.raises(InputError, match="hydra.sweeper.gpu_memory_gib='80G' must be a positive number"):
        job_memory(cfg, [snap], gpu, gpu_memory_gib="80G")


def test_a_model_that_cannot_be_planned_keeps_the_configured_request(monkeypatch, tmp_path):
    unknown = needle_cfg("model.architecture.model_type=gpt2")
    request = job_memory(unknown, SETTINGS, CPU)
    assert request.mem_gb == 2 and "not planned (model_type='gpt2'" in request.line
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))   # nothing cached, and nothing is downloaded
    hub = compose("longbench", ["model=llama-3.1-8b-instruct", "longbench.datasets=[qasper]"])
    request = job_memory(hub, SETTINGS, CPU)
    assert request.mem_gb == 2 and "not planned" in request.line and "\n" not in request.line
    assert job_memory(compose("observe", []), SETTINGS, CPU).line.endswith("mem_gb=2 as configured")


def sweep_groups(tmp_path, jobs):
    def compose_job(overrides):
        return compose("needle", ["model=tiny-llama", "needle.lengths=[300,600]", "needle.max_new_tokens=8",
                                  "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}", *overrides], hydra_node=True)
    return group_jobs(jobs, compose_job), compose_job


def test_a_group_and_an_array_of_groups(tmp_path):
    jobs = [["compressor=full"], ["compressor=snapkv", "compressor.budget=64", "compressor.window=8"],
            ["compressor=h2o", "compressor.budget=64", "compressor.window=8"],
            ["compressor=full", "needle.lengths=[3000]"]]
    groups, compose_job = sweep_groups(tmp_path, jobs)
    assert [len(g) for g in groups] == [3, 1]
    first = group_request(groups[0], compose_job, CPU)
    assert first.mem_gb == job_memory(needle_cfg(), SETTINGS, CPU).mem_gb
    second = group_request(groups[1], compose_job, CPU)
    assert "at 3000 tokens" in second.line
    assert array_mem_gb([first, second], 2) == max(first.mem_gb, second.mem_gb)
    assert array_mem_gb([SimpleNamespace(mem_gb=None)], 64) == 64


def test_the_sweeper_sets_the_arrays_request(tmp_path, capsys):
    from hydra_plugins.snapkv_bench_shared_prefill import SharedPrefillSweeper
    groups, compose_job = sweep_groups(tmp_path, [["compressor=full"], ["compressor=full", "needle.lengths=[3000]"]])
    sweeper = SharedPrefillSweeper()
    sweeper.config = compose_job([])
    sweeper.launcher = SimpleNamespace(params={"mem_gb": 2, "gpus_per_node": 0})
    requests = sweeper._memory_requests(groups, compose_job)
    sweeper._request_memory(requests)
    assert sweeper.launcher.params["mem_gb"] == max(r.mem_gb for r in requests) > 2
    out = capsys.readouterr().out
    assert out.count("shared_prefill: job ") == 2 and "SLURM array of 2 job(s)" in out
    sweeper.config = compose("needle", ["hydra/launcher=local"], hydra_node=True)
    assert sweeper._memory_requests(groups, compose_job) is None    # another launcher: nothing planned
