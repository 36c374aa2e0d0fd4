"""settings.json: the whole config counts, but the fields listed as harmless or derived."""
from pathlib import Path

import pytest

from conftest import compose
from eval.settings import DERIVED, HARMLESS, TASK_SECTIONS, claim, fingerprint
from snapkv.errors import InputError

MODELS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "model").glob("*.yaml"))
CONFIGS = [("longbench", [f"model={m}"]) for m in MODELS] + [
    ("longbench", ["experiment=paper_table1", "model=mistral-7b-instruct-v0.2", "+table1=h2o-4096"]),
    ("longbench", ["experiment=demo", "compressor=pyramidkv"]),
    ("longbench_v2", ["model=tiny-llama"]),
    ("ruler", ["model=tiny-llama", "query_aware=false"]),
    ("math", ["model=tiny-llama", "math.data=tests/fixtures/math/math500.jsonl", "math.dataset=math500"]),
    ("longbench_v2", ["longbench_v2.cot=true", "experiment=demo"]),
    ("needle", ["compressor=streamingllm"]),
    ("needle", ["experiment=paper_needle", "needle.haystack=noise"]),
    ("lines", ["experiment=paper_pooling", "compressor=random"]),
    ("observe", ["experiment=demo"]),
    ("bench", ["experiment=speed_memory", "compressor=h2o"]),
    ("bench", ["experiment=planner_check", "bench.frontier=true"]),
]


def derived_settings(cfg) -> dict:
    """What each task passes to ``fingerprint`` (bench passes its own, left-out fields only)."""
    if cfg.task == "longbench":
        from eval.longbench.predict import task_settings
        return task_settings(cfg)
    if cfg.task == "longbench_v2":
        from eval.longbench_v2.predict import task_settings
        return task_settings(cfg)
    if cfg.task == "needle":
        from eval.needle.__main__ import read_task, task_settings
        return task_settings(read_task(cfg))
    if cfg.task == "math":
        from eval.math.predict import MathTask
        task = MathTask()
        task.check(cfg)
        return task.settings(cfg)
    if cfg.task == "lines":
        from eval.lines.__main__ import LinesGrid
        grid = LinesGrid()
        grid.check(cfg)
        return grid.settings(cfg)
    return {}


def config_fields(cfg):
    """``(section, field)`` of every field a run's fingerprint could hold ("": the top level)."""
    for name in cfg:
        if name not in ("model", "compressor", *TASK_SECTIONS):
            yield "", name
    for section in ("model", "compressor", cfg.task):
        for name in cfg.get(section) or ():
            yield section, name


def composed():
    return [compose(task, [*overrides, "output_dir=/tmp/unused"], hydra_node=True) for task, overrides in CONFIGS]


def test_every_config_field_is_fingerprinted_or_listed():
    seen = set()
    for cfg in composed():
        settings = fingerprint(cfg, derived_settings(cfg))
        for section, name in config_fields(cfg):
            seen.add((section, name))
            listed = name in HARMLESS.get(section, ()) or name in DERIVED.get(section, ())
            key = f"{section}.{name}" if section else name
            assert (key in settings) != listed or section == "compressor" and name == "tag", (cfg.task, key)
    stale = {(s, n) for lists in (HARMLESS, DERIVED) for s, names in lists.items() for n in names} - seen
    assert not stale, f"listed fields no config has: {sorted(stale)}"


def test_derived_values_replace_the_raw_fields():
    settings = fingerprint(cfg := compose("needle", ["needle.haystack=.", "output_dir=/tmp/unused"]),
                           derived_settings(cfg))
    assert settings["needle.haystack"] == str(Path(".").resolve()) and settings["needle.chat_format"] == "template"
    assert settings["needle.needles"] == [[cfg.needle.needle, cfg.needle.answer]] and "needle.answer" not in settings
    settings = fingerprint(cfg := compose("longbench", ["output_dir=/tmp/unused"]), derived_settings(cfg))
    assert settings["longbench.data_source"] == "hub:THUDM/LongBench@main" and "longbench.revision" not in settings


@pytest.mark.parametrize("added", ["+longbench.new_knob", "+model.new_knob", "+new_knob"])
def test_a_field_added_to_a_config_counts(tmp_path, added):
    def settings(value):
        cfg = compose("longbench", [f"{added}={value}", f"output_dir={tmp_path}"])
        return fingerprint(cfg, derived_settings(cfg))
    claim(tmp_path, settings(1), "auto", ())
    claim(tmp_path, settings(1), "auto", ())
    key = added.lstrip("+")
    with pytest.raises(InputError, match=f"{key} 1 -> 2"):
        claim(tmp_path, settings(2), "auto", ())


def test_another_tasks_section_does_not_count():
    # the demo experiment sets the needle section of every task's config
    cfg = compose("longbench", ["experiment=demo", "+needle.new_knob=1", "output_dir=/tmp/unused"])
    assert not any(key.startswith("needle.") for key in fingerprint(cfg, derived_settings(cfg)))
