"""One writer per run folder (two local processes), and nothing of a job left alive after it."""
import json
import signal
import subprocess
import sys
import time
import weakref


from conftest import ROOT, compose

HOLD = """
import sys, time
from pathlib import Path
from eval.runlock import run_lock
with run_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(60)
"""


def holder(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def needle_cli(folder, *extra):
    return subprocess.run([sys.executable, "-m", "eval.needle", "model=tiny-llama", "compressor=full",
                           "needle.lengths=[300]", "needle.depths=[0]", "needle.max_new_tokens=1",
                           f"output_dir={folder}", *extra], capture_output=True, text=True, cwd=ROOT)


def test_a_second_process_on_the_same_run_folder_stops_with_one_line(tmp_path):
    proc = holder(tmp_path)
    try:
        second = needle_cli(tmp_path)
        assert second.returncode == 2
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: output_dir={tmp_path} is in use by process {proc.pid}")
        assert not (tmp_path / "needle.jsonl").exists()
    finally:
        proc.kill()
        proc.wait()
    # the holder was killed: its lock went with it, the same command now runs
    third = needle_cli(tmp_path)
    assert third.returncode == 0, third.stderr[-1500:]
    assert len((tmp_path / "needle.jsonl").read_text().splitlines()) == 1


def test_a_waiting_process_runs_once_the_holder_is_done(tmp_path):
    proc = holder(tmp_path)
    waiter = subprocess.Popen([sys.executable, "-m", "eval.needle", "model=tiny-llama", "compressor=full",
                               "needle.lengths=[300]", "needle.depths=[0]", "needle.max_new_tokens=1",
                               "lock_wait_s=60", f"output_dir={tmp_path}"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert waiter.poll() is None and not (tmp_path / "needle.jsonl").exists()
    proc.kill()
    proc.wait()
    assert waiter.wait(timeout=120) == 0
    assert (tmp_path / "needle.jsonl").exists()


def start_slow_sweep(tmp_path):
    """A 24-cell needle sweep in its own process, once its first cell is written: (process, cells file)."""
    slow = subprocess.Popen([sys.executable, "-m", "eval.needle", "-m", "model=tiny-llama", "compressor=full",
                             "needle.lengths=[300,400,500,600,700,800,900,1000]", "needle.depths=[0,50,100]",
                             "needle.max_new_tokens=1", f"hydra.sweep.dir={tmp_path}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cells = tmp_path / "tiny-llama" / "full" / "needle.jsonl"
    for _ in range(600):
        if cells.exists() and cells.read_text().count("\n") >= 1:
            break
        time.sleep(0.1)
    return slow, cells


def test_sigterm_leaves_a_failure_record_and_a_finished_run_clears_it(tmp_path):
    slow, cells = start_slow_sweep(tmp_path)
    slow.send_signal(signal.SIGTERM)
    slow.wait(timeout=60)
    failed = json.loads((cells.parent / "failed.json").read_text())
    assert "SIGTERM" in failed["error"]
    done = subprocess.run([sys.executable, "-m", "eval.needle", "-m", "model=tiny-llama", "compressor=full",
                           "needle.lengths=[300,400,500,600,700,800,900,1000]", "needle.depths=[0,50,100]",
                           "needle.max_new_tokens=1", f"hydra.sweep.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
    assert not (cells.parent / "failed.json").exists()
    assert len(cells.read_text().splitlines()) == 24


def test_a_job_killed_outright_still_leaves_a_failure_record(tmp_path):
    """SIGKILL (a scheduler's kill after its grace period, the OOM killer) runs no handler: the record
    every job writes when it starts stays."""
    from eval.hydra_app import UNFINISHED
    slow, cells = start_slow_sweep(tmp_path)
    slow.kill()
    slow.wait(timeout=60)
    assert json.loads((cells.parent / "failed.json").read_text())["error"] == UNFINISHED


def test_the_model_of_a_job_is_freed_when_it_ends(tmp_path, monkeypatch):
    import eval.runner
    from eval.hydra_app import run_guarded
    from eval.needle.__main__ import run
    models = []
    real = eval.runner.load_model

    def tracked(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        models.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(eval.runner, "load_model", tracked)
    run_guarded(run, compose("needle", ["model=tiny-llama", "compressor=full", "needle.lengths=[300]",
                                        "needle.depths=[0]", "needle.max_new_tokens=1", f"output_dir={tmp_path}"]))
    assert len(models) == 1 and models[0]() is None


def test_models_kept_loaded_serve_every_job_of_a_process_one_model(tmp_path, monkeypatch):
    """make demo runs its parts in one process: inside ``models_kept_loaded`` a second job gets the
    model the first one loaded (one load, the same records); outside, each job loads and frees its own."""
    import eval.runner
    from eval.hydra_app import run_guarded
    from eval.needle.__main__ import run
    loads = []
    real = eval.runner._load_model
    monkeypatch.setattr(eval.runner, "_load_model", lambda *a, **k: loads.append(1) or real(*a, **k))

    def job(folder):
        run_guarded(run, compose("needle", ["model=tiny-llama", "compressor=full", "needle.lengths=[300]",
                                            "needle.depths=[0]", "needle.max_new_tokens=2",
                                            f"output_dir={tmp_path / folder}"]))
        record = json.loads((tmp_path / folder / "needle.jsonl").read_text())
        return {k: v for k, v in record.items() if not k.endswith("_s") and k != "cost"}  # measurements aside
    with eval.runner.models_kept_loaded():
        first, second = job("a"), job("b")
        model, _ = eval.runner.load_model(compose("needle", ["model=tiny-llama"]).model, "cpu")
        assert model is eval.runner.load_model(compose("needle", ["model=tiny-llama"]).model, "cpu")[0]
    assert len(loads) == 1 and first == second
    job("c")
    assert len(loads) == 2
