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
    presets = {"snapkv_needle": "snapkv", "adakv_expected_attention": "adakv"}  # option files of a method's
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
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 job(s) failed" in proc.stderr and "compressor.kernel=4" in proc.stderr
    assert list(tmp_path.rglob("bench.json")), "the other job still ran"


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
