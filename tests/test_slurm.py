"""The cluster path on a real one-node SLURM (scripts/local_slurm.sh: slurm-wlm, slurmdbd on MariaDB,
munge): a 3-job needle sweep through hydra-submitit-launcher, one job cancelled with scancel and
one preempted (USR2, requeued by submitit) while running, then the same command again."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from eval.hydra_app import UNFINISHED

# one file, so one worker of make test's two runs them one after the other (--dist loadfile): they share the
# one-node cluster's two CPUs
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def slurm_up() -> str | None:
    """None when a cluster answers (started here if need be), else why not."""
    if shutil.which("sinfo") and subprocess.run(["bash", "scripts/local_slurm.sh", "status"], cwd=ROOT).returncode == 0:
        return None
    if os.geteuid() != 0:
        return "SLURM is not running and starting it needs root"
    if not shutil.which("apt-get"):
        return "SLURM is not running and there is no apt-get to install it"
    proc = subprocess.run(["bash", "scripts/local_slurm.sh"], cwd=ROOT, capture_output=True, text=True)
    return None if proc.returncode == 0 else f"scripts/local_slurm.sh failed: {proc.stderr.strip()[-300:]}"


BUDGETS = (64, 96, 128)
CELLS = 24


def sweep(folder, max_new_tokens=96):
    return [sys.executable, "-m", "eval.needle", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=cpu",
            "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
            "hydra.launcher.timeout_min=15", "model=tiny-llama", "compressor.window=8",
            "compressor.budget=" + ",".join(map(str, BUDGETS)), "needle.lengths=[300,400,500,600]",
            "needle.depths=[0,20,40,60,80,100]", f"needle.max_new_tokens={max_new_tokens}", f"hydra.sweep.dir={folder}"]


def cells_of(folder, budget):
    path = folder / "tiny-llama" / f"snapkv-b{budget}-w8-k7-maxpool-mean" / "needle.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def sacct_states() -> str:
    return subprocess.run(["sacct", "-X", "-o", "JobID,State,ExitCode"], capture_output=True, text=True).stdout


def wait_for(job: str, state: str, release: bool = False, timeout: float = 240) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = [line.split() for line in sacct_states().splitlines()[2:]]
        if any(parts[0] == job and parts[1] == state for parts in states if len(parts) > 1):
            return True
        if release:
            pending = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout
            if "PENDING" in pending and "BeginTime" in pending:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        time.sleep(1)
    return False


ARRAYS: dict = {}


def array_job_id(folder) -> str:
    return ARRAYS[str(folder)]


def array_job(folder) -> str:
    if str(folder) in ARRAYS:
        return ARRAYS[str(folder)]
    for _ in range(600):
        out = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            job, command = line.split(" ", 1)
            if str(folder) in command:
                ARRAYS[str(folder)] = job.split("_")[0]
                return ARRAYS[str(folder)]
        time.sleep(0.2)
    raise AssertionError("the sweep's job array never showed up in squeue")


def test_sweep_survives_scancel_and_preemption(tmp_path):
    reason = slurm_up()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "SNAPKV_BENCH_HOME": str(ROOT)}
    first = subprocess.Popen(sweep(tmp_path), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    acted = set()
    deadline = time.time() + 240
    while first.poll() is None and time.time() < deadline and len(acted) < 2:
        for index, signal_args in ((0, []), (1, ["--signal=USR2"])):
            if index not in acted and len(cells_of(tmp_path, BUDGETS[index])) >= 2:
                array = array_job(tmp_path)
                subprocess.run(["scancel", *signal_args, f"{array}_{index}"], check=True)
                acted.add(index)
        time.sleep(0.2)
    log = first.communicate(timeout=300)[0]
    assert acted == {0, 1}, f"jobs finished before they could be cancelled/preempted:\n{log[-3000:]}"
    cancelled = tmp_path / "tiny-llama" / f"snapkv-b{BUDGETS[0]}-w8-k7-maxpool-mean"
    kept_before = cells_of(tmp_path, BUDGETS[0])
    assert len(kept_before) >= 2
    job = f"{array_job_id(tmp_path)}_0"
    if wait_for(job, "COMPLETED", timeout=5):
        # a fast machine: the job wrote its last cell before the cancel reached it, and the launcher
        # rightly saw nothing fail; the rerun below must then find nothing to do for it
        assert len(kept_before) == CELLS and not (cancelled / "failed.json").exists(), sacct_states()
    else:
        assert first.returncode != 0, log[-3000:]                     # the launcher saw a cancelled job
        # the SIGTERM handler's reason, or (killed before it ran: KillWait is 5 s here) the record the
        # job wrote when it started
        error = json.loads((cancelled / "failed.json").read_text())["error"]
        assert "SIGTERM" in error or error == UNFINISHED, error
    # the preempted job was requeued by submitit; SLURM holds a requeued job ~2 minutes (BeginTime),
    # which the test shortens, then it resumes from its results file and finishes on its own
    preempted = f"{array_job_id(tmp_path)}_1"
    assert wait_for(preempted, "COMPLETED", release=True), sacct_states()
    assert len(cells_of(tmp_path, BUDGETS[1])) == CELLS
    again = subprocess.run(sweep(tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for budget in BUDGETS:
        cells = cells_of(tmp_path, budget)
        keys = [(c["context_length"], c["depth_percent"]) for c in cells]
        assert len(cells) == CELLS and len(set(keys)) == CELLS, budget      # every cell once
    assert cells_of(tmp_path, BUDGETS[0])[: len(kept_before)] == kept_before   # cells done before the cancel kept
    assert not (cancelled / "failed.json").exists()


def test_a_shared_prefill_sweep_cancelled_midway_resumes(tmp_path):
    """hydra/sweeper=shared_prefill on SLURM: six jobs as one job of four settings, cancelled while it runs, then
    the same command again: every setting's folder completes, each cell once, the failure records gone."""
    reason = slurm_up()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "SNAPKV_BENCH_HOME": str(ROOT)}
    # long answers: the group job must still be running when SIGKILL follows the cancel (KillWait=5 s),
    # whatever the machine's speed (at 8 tokens a fast machine finishes all 24 cells within those 5 s)
    command = [*sweep(tmp_path), "hydra/sweeper=shared_prefill", "compressor=full,snapkv"]
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    cancelled = False
    while first.poll() is None and time.time() < deadline:
        if len(cells_of(tmp_path, BUDGETS[0])) >= 2:
            subprocess.run(["scancel", array_job(tmp_path)], check=True)
            cancelled = True
            break
        time.sleep(0.2)
    log = first.communicate(timeout=300)[0]
    assert cancelled, f"the group job finished before it could be cancelled:\n{log[-3000:]}"
    assert "6 jobs -> 1 job(s)" in log   # full x 3 budgets is one setting: 4 settings
    # the planner raised the request above the configured 2 GB (eval/job_memory.py: ceil(peak x 1.25 + 3))
    assert "SLURM array of 1 job(s): mem_gb=4 (configured 2)" in log, log[-3000:]
    requested = subprocess.run(["sacct", "-X", "-n", "-j", array_job_id(tmp_path), "-o", "ReqMem"],
                               capture_output=True, text=True).stdout.split()
    assert requested and all(m.startswith("4") for m in requested), requested
    folders = [tmp_path / "tiny-llama" / "full"] + \
        [tmp_path / "tiny-llama" / f"snapkv-b{b}-w8-k7-maxpool-mean" for b in BUDGETS]
    assert all((folder / "failed.json").exists() for folder in folders)
    kept_before = cells_of(tmp_path, BUDGETS[0])
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for folder in folders:
        cells = [json.loads(l) for l in (folder / "needle.jsonl").read_text().splitlines()]
        keys = [(c["context_length"], c["depth_percent"]) for c in cells]
        assert len(cells) == CELLS and len(set(keys)) == CELLS, folder
        assert not (folder / "failed.json").exists()
    assert cells_of(tmp_path, BUDGETS[0])[: len(kept_before)] == kept_before
