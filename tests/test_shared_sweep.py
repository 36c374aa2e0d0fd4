"""Shared prefill in the tasks: a group job writes, for every setting, the folder, settings.json and
record lines its solo run writes (float32, CPU); resume per setting; the OOM fallback; grouping."""
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import compose
from eval.sweep_groups import group_jobs, write_group

SETTINGS = [
    ["compressor=full"],
    ["compressor=snapkv", "compressor.budget=64", "compressor.window=8", "compressor.kernel=5"],
    ["compressor=snapkv", "compressor.budget=128", "compressor.window=8", "compressor.kernel=5"],
    ["compressor=snapkv", "compressor.budget=64", "compressor.window=8", "compressor.kernel=3"],
    ["compressor=pyramidkv", "compressor.budget=64", "compressor.window=8"],
    ["compressor=h2o", "compressor.budget=64", "compressor.window=8"],
    ["compressor=streamingllm", "compressor.budget=64"],
]
TASKS = {
    # the rows cut to 1,024 tokens (LongBench's middle truncation): far above every budget here, a quarter of the work
    "longbench": ["longbench.datasets=[multi_news]", "longbench.data_dir=eval/data/longbench_sample",
                  "longbench.limit=2", "longbench.max_new_tokens=4", "model.max_length=1024"],
    "needle": ["needle.haystack=noise", "needle.lengths=[300,500]", "needle.depths=[0,60]", "needle.max_new_tokens=3"],
    "lines": ["lines.lengths=[300]", "lines.depths=[0,100]", "lines.max_new_tokens=3"],
}
RESULTS = {"longbench": "pred/multi_news.jsonl", "needle": "needle.jsonl", "lines": "lines.jsonl"}
TIMINGS = ("prefill_s", "build_s", "cost")  # measurements, not results


def task_run(task):
    from importlib import import_module
    return import_module(f"eval.{task}.__main__").run


def records(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in path.read_text().splitlines()]


def shared_job(task, base, jobs, sweep_dir):
    """What the sweeper does: group the jobs, write the group file, compose the group's job."""
    def compose_job(overrides):
        return compose(task, base + [f"hydra.sweep.dir={sweep_dir}", *overrides], hydra_node=True)
    groups = group_jobs(jobs, compose_job)
    assert len(groups) == 1
    members = groups[0]
    path = write_group(Path(sweep_dir), members)
    cfg = compose(task, base + members[0].overrides + [f"shared_prefill.group={path}",
                                                       f"output_dir={members[0].output_dir}"])
    return cfg, members


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("task", sorted(TASKS))
def test_shared_prefill_records_equal_solo_runs(tmp_path, task, attn):
    base = ["model=tiny-llama", f"model.attn_implementation={attn}", *TASKS[task]]
    run = task_run(task)
    cfg, members = shared_job(task, base, SETTINGS, tmp_path / "shared")
    assert len(members) == len(SETTINGS)
    run(cfg)
    for overrides, member in zip(SETTINGS, members):
        solo = tmp_path / "solo" / Path(member.output_dir).name
        run(compose(task, base + overrides + [f"output_dir={solo}"]))
        shared = Path(member.output_dir)
        assert json.loads((shared / "settings.json").read_text()) == json.loads((solo / "settings.json").read_text())
        assert (shared / "compressor.json").read_text() == (solo / "compressor.json").read_text()
        assert records(shared / RESULTS[task]) == records(solo / RESULTS[task]), member.output_dir


def test_group_resumes_per_setting_and_skips_finished_settings(tmp_path, monkeypatch):
    from eval.runner import Runner
    base = ["model=tiny-llama", *TASKS["needle"]]
    run = task_run("needle")
    settings = SETTINGS[:3]
    # one setting already finished two cells alone
    first = compose("needle", base + settings[1] + ["needle.lengths=[300]", f"output_dir={tmp_path}/x"])
    cfg, members = shared_job("needle", base, settings, tmp_path / "shared")
    first.output_dir = members[1].output_dir
    run(first)
    calls = []
    real = Runner.generate_shared

    def spy(self, ids, compressors, *args, **kwargs):
        calls.append([c.label() for c in compressors])
        return real(self, ids, compressors, *args, **kwargs)
    monkeypatch.setattr(Runner, "generate_shared", spy)
    run(cfg)
    # the cells at 300 tokens ran for the two other settings only; those at 500 for all three
    assert [len(c) for c in calls] == [2, 2, 3, 3]
    for member in members:
        cells = records(Path(member.output_dir) / "needle.jsonl")
        assert sorted((c["context_length"], c["depth_percent"]) for c in cells) == \
            [(300, 0.0), (300, 60.0), (500, 0.0), (500, 60.0)]
    calls.clear()
    run(cfg)  # everything is there: nothing runs
    assert calls == []


def test_out_of_memory_in_a_shared_prefill_retries_each_setting_alone(tmp_path, monkeypatch):
    import snapkv
    from eval.runner import Runner
    base = ["model=tiny-llama", *TASKS["longbench"]]
    settings = SETTINGS[:3]
    cfg, members = shared_job("longbench", base, settings, tmp_path / "shared")

    def shared_oom(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
    real = Runner.generate

    def solo_oom_for_full(self, ids, compressor, *args, **kwargs):
        if isinstance(compressor, snapkv.FullKV):
            raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return real(self, ids, compressor, *args, **kwargs)
    monkeypatch.setattr(Runner, "generate_shared", shared_oom)
    monkeypatch.setattr(Runner, "generate", solo_oom_for_full)
    task_run("longbench")(cfg)
    for member in members:
        lines = records(Path(member.output_dir) / RESULTS["longbench"])
        assert len(lines) == 2
        assert all(l.get("oom", False) == (member.compressor["method"] == "full") for l in lines)


def test_settings_a_method_ignores_collapse_into_one_folder(tmp_path):
    jobs = [["compressor=full", "compressor.budget=64"], ["compressor=full", "compressor.budget=128"],
            ["compressor=snapkv", "compressor.budget=64"], ["compressor=snapkv", "compressor.budget=128"],
            ["compressor=h2o", "compressor.kernel=5"], ["compressor=h2o", "compressor.kernel=7"]]

    def compose_job(overrides):
        return compose("needle", ["model=tiny-llama", f"hydra.sweep.dir={tmp_path}", *overrides], hydra_node=True)
    groups = group_jobs(jobs, compose_job)
    assert len(groups) == 1
    folders = [Path(m.output_dir).name for m in groups[0]]
    assert folders == ["full", "snapkv-b64-w32-k7-maxpool-mean", "snapkv-b128-w32-k7-maxpool-mean",
                       "h2o-b4096-w32-mean-model"]
    assert groups[0][0].overrides == ["compressor=full"] and groups[0][0].compressor["budget"] is None


def test_jobs_that_differ_elsewhere_are_separate_groups(tmp_path):
    jobs = [[f"model={m}", f"compressor.budget={b}"] for m in ("tiny-llama", "smollm2-135m") for b in (64, 128)]

    def compose_job(overrides):
        return compose("needle", [f"hydra.sweep.dir={tmp_path}", *overrides], hydra_node=True)
    groups = group_jobs(jobs, compose_job)
    assert [[Path(m.output_dir).parent.name for m in g] for g in groups] == \
        [["tiny-llama", "tiny-llama"], ["smollm2-135m", "smollm2-135m"]]


def test_two_settings_in_one_folder_are_an_error(tmp_path):
    def compose_job(overrides):
        return compose("needle", ["model=tiny-llama", f"hydra.sweep.dir={tmp_path}", *overrides], hydra_node=True)
    with pytest.raises(ValueError, match="two settings write .*compressor.tag"):
        group_jobs([["compressor.kernel=5", "compressor.tag=same"], ["compressor.kernel=7", "compressor.tag=same"]],
                   compose_job)


def test_missing_group_file_is_one_clear_error(tmp_path):
    cfg = compose("needle", ["model=tiny-llama", f"shared_prefill.group={tmp_path}/nope.json",
                             f"output_dir={tmp_path}/run"])
    with pytest.raises(ValueError, match="shared_prefill.group=.*no such file"):
        task_run("needle")(cfg)


def needle_multirun(tmp_path, *sweeper):
    """``compressor=full,snapkv compressor.budget=64,128`` as a real needle multirun on the tiny model."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "eval.needle", "-m", *sweeper, "model=tiny-llama",
                           "compressor=full,snapkv", "compressor.budget=64,128", "compressor.window=8",
                           "needle.lengths=[300]", "needle.depths=[50]", "needle.max_new_tokens=2",
                           f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_sweeper_runs_a_multirun_as_one_job_per_group(tmp_path):
    proc = needle_multirun(tmp_path, "hydra/sweeper=shared_prefill")
    assert "4 jobs -> 1 job(s)" in proc.stdout
    folders = sorted(p.parent.name for p in tmp_path.glob("tiny-llama/*/needle.jsonl"))
    assert folders == ["full", "snapkv-b128-w8-k7-maxpool-mean", "snapkv-b64-w8-k7-maxpool-mean"]
    assert len(list(tmp_path.glob(".shared_prefill/group-*.json"))) == 1


@pytest.mark.parametrize("preset", ["paper_table1", "paper_hyperparams", "paper_needle", "paper_pooling"])
def test_paper_presets_share_the_prefill(preset):
    task = {"paper_needle": "needle", "paper_pooling": "lines"}.get(preset, "longbench")
    cfg = compose(task, [f"experiment={preset}"], hydra_node=True)
    assert cfg.hydra.sweeper._target_.endswith("SharedPrefillSweeper")


def test_table1_preset_is_one_group_of_its_five_settings(tmp_path):
    cfg = compose("longbench", ["experiment=paper_table1"], hydra_node=True)
    settings = str(cfg.hydra.sweeper.params["+table1"]).split(",")
    jobs = [["experiment=paper_table1", "model=mistral-7b-instruct-v0.2", f"+table1={s}"] for s in settings]
    groups = group_jobs(jobs, lambda o: compose("longbench", [f"hydra.sweep.dir={tmp_path}", *o], hydra_node=True))
    assert len(groups) == 1
    assert [(m.compressor["method"], m.compressor["budget"]) for m in groups[0]] == \
        [("full", None), ("snapkv", 1024), ("snapkv", 2048), ("snapkv", 4096), ("h2o", 4096)]
    assert all(m.compressor["gqa"] == "repeat" for m in groups[0])


def test_decode_together_records_its_mode_and_keeps_exact_folders_apart(tmp_path, monkeypatch):
    from eval.runner import Runner
    base = ["model=tiny-llama", *TASKS["longbench"]]
    together = []
    real = Runner.generate_shared

    def spy(self, *args, **kwargs):
        together.append(kwargs.get("together"))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Runner, "generate_shared", spy)
    cfg, members = shared_job("longbench", base + ["shared_prefill.decode_together=true"], SETTINGS[:4],
                              tmp_path / "shared")
    task_run("longbench")(cfg)
    assert together == [True, True]
    exact, _ = shared_job("longbench", base, SETTINGS[:4], tmp_path / "exact")
    task_run("longbench")(exact)
    for member in members:
        batched = Path(member.output_dir)
        solo = tmp_path / "exact" / batched.relative_to(tmp_path / "shared")
        assert json.loads((batched / "settings.json").read_text())["shared_prefill.decode_together"] is True
        assert "shared_prefill.decode_together" not in json.loads((solo / "settings.json").read_text())
        assert records(batched / RESULTS["longbench"]) == records(solo / RESULTS["longbench"])
    import snapkv
    exact.shared_prefill.decode_together = True  # batched records into the exact run's folders
    with pytest.raises(snapkv.InputError, match="shared_prefill.decode_together"):
        task_run("longbench")(exact)


def test_the_leaderboard_preset_is_one_group_of_every_entry_at_every_ratio_and_full(tmp_path):
    """experiment=kvpress_leaderboard: RULER 4K, query-agnostic, full KV once and each entry of
    eval.leaderboard at kvpress's four ratios with its SnapKV-family defaults, one shared prefill."""
    from eval import leaderboard
    from eval.hydra_app import make_compressor
    cfg = compose("ruler", ["experiment=kvpress_leaderboard"], hydra_node=True)
    assert cfg.query_aware is False and list(cfg.ruler.lengths) == [leaderboard.LENGTH]
    assert cfg.hydra.sweeper._target_.endswith("SharedPrefillSweeper")
    options = str(cfg.hydra.sweeper.params["compressor"]).split(",")
    assert options == ["full", *leaderboard.ENTRIES]
    ratios = [float(r) for r in str(cfg.hydra.sweeper.params["compressor.ratio"]).split(",")]
    assert ratios == list(leaderboard.RATIOS)
    jobs = [["experiment=kvpress_leaderboard", "model=llama-3.1-8b-instruct", f"compressor={o}",
             f"compressor.ratio={r}"] for o in options for r in ratios]
    groups = group_jobs(jobs, lambda o: compose("ruler", [f"hydra.sweep.dir={tmp_path}", *o], hydra_node=True))
    assert len(groups) == 1 and len(groups[0]) == 1 + len(leaderboard.ENTRIES) * len(ratios)
    built = [make_compressor(OmegaConf.create(m.compressor)) for m in groups[0]]
    from eval.bench.sweep import settings_of
    assert [c.label() for c in built] == [c.label() for c in settings_of("leaderboard")]


def test_a_plain_multirun_runs_full_kv_once_whatever_budgets_it_sweeps(tmp_path):
    """The basic sweeper, as the paper's sweep is usually typed: full's budget is dropped (a note), so its
    jobs are one run in one folder, written once; the other settings run as usual."""
    proc = needle_multirun(tmp_path)
    assert "compressor=full keeps every token; compressor.budget, compressor.window ignored" in proc.stdout
    folders = sorted(p.parent.name for p in tmp_path.glob("tiny-llama/*/needle.jsonl"))
    assert folders == ["full", "snapkv-b128-w8-k7-maxpool-mean", "snapkv-b64-w8-k7-maxpool-mean"]
    assert len((tmp_path / "tiny-llama" / "full" / "needle.jsonl").read_text().splitlines()) == 1
    assert not list(tmp_path.glob("tiny-llama/*/failed.json"))



def shared_sweep(tmp_path, *overrides):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "eval.needle", "-m", "hydra/sweeper=shared_prefill",
                           "model=tiny-llama", *overrides, f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=600)


def test_a_failed_group_names_each_setting_by_its_own_overrides_and_exits_1(tmp_path):
    """A group of budgets 128 and 256 that fails (an even kernel): each setting's folder gets a failure
    record with that setting's overrides, the summary lists both, and the sweep exits 1."""
    proc = shared_sweep(tmp_path, "compressor=snapkv", "compressor.kernel=4", "compressor.budget=128,256",
                        "compressor.window=8", "needle.lengths=[300]", "needle.depths=[50]", "needle.max_new_tokens=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "2 jobs -> 1 job(s)" in proc.stdout
    summary = [line.split(": ")[0].split() for line in proc.stderr.split("2 job(s) failed:")[1].splitlines()
               if "kernel=4 must be odd" in line]
    assert sorted(b for overrides in summary for b in overrides if b.startswith("compressor.budget=")) == \
        ["compressor.budget=128", "compressor.budget=256"]
    assert not any(o.startswith("shared_prefill.group=") for overrides in summary for o in overrides)
    for budget in (128, 256):
        folder = tmp_path / "tiny-llama" / f"snapkv-b{budget}-w8-k4-maxpool-mean"
        failed = json.loads((folder / "failed.json").read_text())
        assert f"compressor.budget={budget}" in failed["overrides"] and "must be odd" in failed["error"]


def test_a_sweep_the_sweeper_refuses_is_one_line_and_exit_2(tmp_path):
    proc = shared_sweep(tmp_path, "compressor.kernel=5,7", "compressor.tag=same")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: two settings write") and proc.stderr.count("\n") == 1, proc.stderr
