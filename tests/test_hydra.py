"""Config composition: every task x model x compressor, presets, the SLURM launcher, run names."""
import pickle

import pytest

from conftest import ROOT, compose
from eval.hydra_app import make_compressor

MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
COMPRESSORS = sorted(p.stem for p in (ROOT / "conf" / "compressor").glob("*.yaml"))


@pytest.mark.parametrize("task", ["longbench", "needle", "bench"])
@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes(task, model):
    cfg = compose(task, [f"model={model}"], hydra_node=True)
    assert cfg.model.name == model
    assert cfg.hydra.run.dir == f"results/runs/{task}/{model}/{cfg.compressor.tag}"
    assert cfg.model.max_length and cfg.model.chat_format


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_every_compressor_builds(compressor):
    cfg = compose("longbench", [f"compressor={compressor}"])
    from eval.compressor_configs import entry_options
    # option files of a method's: a preset, and the kvpress entries that set fields of their own
    presets = {"snapkv_needle": "snapkv", **{option: method for option, (method, _, _) in entry_options().items()}}
    assert make_compressor(cfg.compressor).method == presets.get(compressor, compressor)


def test_lwm_config_for_the_documented_gpu_command():
    cfg = compose("longbench", ["model=lwm-1m"])
    assert cfg.model.path == "LargeWorldModel/LWM-Text-Chat-1M" and cfg.model.chat_format == "llama2"
    assert cfg.longbench.data_dir is None and len(cfg.longbench.datasets) == 16


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_experiments_compose(experiment):
    for task in ("longbench", "needle", "bench"):
        cfg = compose(task, [f"experiment={experiment}"], hydra_node=True)
        make_compressor(cfg.compressor)


def test_paper_needle_preset():
    cfg = compose("needle", ["experiment=paper_needle"])
    c = make_compressor(cfg.compressor)
    assert (cfg.model.name, c.budget, c.window, c.kernel, c.pooling) == ("lwm-1m", 1024, 16, 5, "maxpool")
    from eval.needle.grid import depths_from, lengths_from
    assert len(lengths_from(cfg.needle)) == 45 and len(depths_from(cfg.needle)) == 10
    assert cfg.needle.scorer == "rouge1" and "Dolores Park" in cfg.needle.needle


def test_paper_needle_preset_with_full_kv_baseline():
    cfg = compose("needle", ["experiment=paper_needle", "compressor=full"])
    assert make_compressor(cfg.compressor).method == "full"
    assert cfg.model.name == "lwm-1m" and cfg.needle.grid == "paper"


def test_run_dirs_differ_by_swept_values():
    a = compose("longbench", ["compressor.budget=1024", "compressor.pooling=maxpool"], hydra_node=True)
    b = compose("longbench", ["compressor.budget=2048", "compressor.pooling=avgpool"], hydra_node=True)
    assert a.hydra.run.dir != b.hydra.run.dir
    assert a.hydra.sweep.subdir == "smollm2-135m/snapkv-b1024-w32-k7-maxpool-mean"


def test_slurm_launcher_composes_and_job_is_picklable():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = compose("longbench", ["hydra/launcher=slurm", "hydra.launcher.partition=a100"], hydra_node=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node) == ("a100", 1)
    assert launcher.timeout_min > 0 and launcher.mem_gb > 0 and launcher.setup
    import cloudpickle
    from eval.longbench.__main__ import main, run
    for fn in (main, run):
        assert pickle.loads(cloudpickle.dumps(fn)) is not None


def test_multirun_sweep_reports_failures_and_goes_on(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "eval.bench", "-m", "model=tiny-llama", "compressor.kernel=4,5",
                           "bench.lengths=[64]", "bench.budgets=[48]", "compressor.window=8", "bench.repeats=3",
                           "bench.decode_tokens=2", "bench.fresh_process=false", f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]  # one failed job among passing ones: the sweep failed
    assert "1 job(s) failed" in proc.stderr and "compressor.kernel=4" in proc.stderr
    assert proc.stderr.rstrip().endswith("exit status 1)"), "the summary comes last"
    assert list(tmp_path.rglob("bench.json")), "the other job still ran"


NEEDLE = ["model=tiny-llama", "compressor=snapkv", "compressor.window=8", "needle.lengths=[300]", "needle.depths=[50]",
          "needle.max_new_tokens=2"]


def needle_sweep(tmp_path, *overrides):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "eval.needle", "-m", *NEEDLE, *overrides,
                           f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_a_multirun_whose_every_job_fails_exits_1_after_its_summary(tmp_path):
    """The same input as a single run exits 2 with one line; as a sweep, every job is recorded and listed, and
    the command exits 1 (Makefiles, CI and SLURM dependency chains read it)."""
    proc = needle_sweep(tmp_path, "compressor.kernel=4", "compressor.budget=128,256")
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = proc.stderr[proc.stderr.index("2 job(s) failed:"):]
    for budget in (128, 256):
        line = next(l for l in summary.splitlines() if f"compressor.budget={budget}" in l.split(": ")[0].split())
        assert "kernel=4 must be odd" in line
    assert len(list(tmp_path.rglob("failed.json"))) == 2


def test_a_passing_multirun_exits_0_and_counts_only_its_own_failures(tmp_path):
    """Records of an earlier sweep in the same sweep directory: one in a folder this sweep runs (its job
    finishes and removes it), one in a folder it does not run (not this sweep's failure: kept, not listed)."""
    import json
    rerun = tmp_path / "tiny-llama" / "snapkv-b64-w8-k7-maxpool-mean"
    other = tmp_path / "tiny-llama" / "snapkv-b999-w8-k7-maxpool-mean"
    for folder, sweep in ((rerun, "an-earlier-sweep"), (other, None)):
        folder.mkdir(parents=True)
        (folder / "failed.json").write_text(json.dumps({"overrides": ["old"], "error": "RuntimeError: old",
                                                        "multirun": True, "sweep": sweep}))
    proc = needle_sweep(tmp_path, "compressor.budget=64,128")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "failed" not in proc.stderr
    assert not (rerun / "failed.json").exists() and (other / "failed.json").exists()
    assert len(list(tmp_path.glob("tiny-llama/*/needle.jsonl"))) == 2


def test_the_summary_counts_this_sweeps_records_only(tmp_path, capsys):
    """Which records under the sweep directory are this sweep's: those with its id, and, where a job could not
    tell its sweep (no id: its launcher passed no environment), those written since the sweep started; never an
    earlier or concurrent sweep's, nor a single run's."""
    import json
    import os
    from omegaconf import OmegaConf
    from eval import hydra_app

    def record(name, **fields):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "failed.json").write_text(json.dumps({"overrides": [f"x={name}"], "error": "E", **fields}))
    record("stale_no_id", multirun=True, sweep=None)
    record("stale_old_format")
    callback = hydra_app.ReportFailures()
    callback.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    try:
        sweep = os.environ[hydra_app.SWEEP_ENV]
        record("ours", multirun=True, sweep=sweep)
        record("other_sweep", multirun=True, sweep="another")
        record("single_run", multirun=False, sweep=None)
        record("ours_no_id", multirun=True, sweep=None)
        callback.on_multirun_end(OmegaConf.create({}))
        assert hydra_app.SWEEP_ENV not in os.environ
        assert sorted(hydra_app._SWEEP.failed) == [str(tmp_path / "ours"), str(tmp_path / "ours_no_id")]
        err = capsys.readouterr().err
        assert "2 job(s) failed:" in err and "x=ours: E" in err and "x=ours_no_id: E" in err
    finally:
        hydra_app._SWEEP = None
        os.environ.pop(hydra_app.SWEEP_ENV, None)


def test_the_exit_status_holds_with_a_submitit_launcher(tmp_path):
    """Jobs in their own processes (submitit's local executor, as SLURM's jobs): the submitting process reads
    the records they wrote under the sweep directory."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import json
    proc = needle_sweep(tmp_path, "hydra/launcher=submitit_local", "compressor.kernel=4,5", "compressor.budget=64")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "1 job(s) failed:" in proc.stderr and "compressor.kernel=4 " in proc.stderr.split("job(s) failed:")[1]
    [failed] = tmp_path.rglob("failed.json")
    assert json.loads(failed.read_text())["sweep"], "the job knew its sweep"
    assert len(list(tmp_path.glob("tiny-llama/*/needle.jsonl"))) == 1


def test_only_the_projects_input_errors_are_one_line_exits(tmp_path, capsys):
    """An InputError prints one line and exits 2; any other ValueError (e.g. from inside torch) keeps
    its traceback."""
    import snapkv
    from eval.hydra_app import run_guarded
    cfg = compose("needle", ["model=tiny-llama", f"output_dir={tmp_path}"])

    def bad_input(_):
        raise snapkv.InputError("needle.depths=[150] must be percents 0-100")

    def internal(_):
        raise ValueError("Expected all tensors to be on the same device")
    with pytest.raises(SystemExit) as exit_info:
        run_guarded(bad_input, cfg)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: needle.depths=[150] must be percents 0-100"
    with pytest.raises(ValueError, match="same device"):
        run_guarded(internal, cfg)
