"""The typed config sections (eval/sections.py): the YAML defaults and the dataclasses agree, Hydra
checks types as it composes, and a value outside a field's choices stops the job with one line."""
import pytest
from omegaconf import OmegaConf

from conftest import ROOT, compose
from eval.sections import SECTIONS, _choices, check_sections

TASKS = ["longbench", "longbench_v2", "needle", "lines", "ruler", "math", "observe", "bench"]
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def _yaml_section(section: str):
    return OmegaConf.load(ROOT / "conf" / f"{section}.yaml").get(section)


@pytest.mark.parametrize("section", sorted(set(SECTIONS) - {"model"}))
def test_the_yaml_defaults_are_the_dataclass_defaults(section):
    """Every key the YAML sets is a typed field, and its value is the field's default (one setting,
    two spellings that a test keeps equal)."""
    yaml = _yaml_section(section)
    schema = OmegaConf.structured(SECTIONS[section])
    assert set(yaml) <= set(schema), f"untyped keys in conf/{section}.yaml: {set(yaml) - set(schema)}"
    for key in yaml:
        if OmegaConf.is_missing(schema, key):
            continue
        assert OmegaConf.to_container(yaml, resolve=False)[key] == OmegaConf.to_container(schema)[key], key


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_is_typed_and_allowed(model):
    yaml = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")
    assert set(yaml) - {"defaults"} <= set(OmegaConf.structured(SECTIONS["model"])), model
    for task in TASKS:
        check_sections(compose(task, [f"model={model}"]))


def test_every_model_field_the_fingerprint_reads_is_typed():
    from eval.settings import MODEL_FIELDS
    assert set(MODEL_FIELDS) <= set(OmegaConf.structured(SECTIONS["model"]))


def test_every_choice_reference_resolves():
    from dataclasses import fields, is_dataclass
    seen = 0
    for schema in SECTIONS.values():
        stack = [schema]
        while stack:
            for f in fields(stack.pop()):
                if "choices" in f.metadata:
                    choices = tuple(_choices(f.metadata["choices"]))
                    assert choices and all(isinstance(c, str) for c in choices), f.name
                    if f.default is not None:
                        assert f.default in choices, f.name
                    seen += 1
                if is_dataclass(f.default_factory):
                    stack.append(f.default_factory)
    assert seen >= 10


def test_a_wrong_type_stops_composition_naming_the_field():
    with pytest.raises(Exception, match="longbench.limit"):
        compose("longbench", ["longbench.limit=abc"])
    with pytest.raises(Exception, match="needle.min_length"):
        compose("needle", ["needle.min_length=[1,2]"])


@pytest.mark.parametrize("override, line", [
    ("longbench_v2.cot=maybe", "error: longbench_v2.cot=maybe: Value 'maybe' is not a valid bool (type str)"),
    ("longbench_v2.nope=1", "error: Could not override 'longbench_v2.nope'; To append to your config use"),
    ("compressor=foo", "error: In 'longbench_v2': Could not find 'compressor/foo'; Available options in "
                       "'compressor': adakv, "),
    ("longbench_v2.limit=[", "error: longbench_v2.limit=[: no viable alternative"),
])
def test_hydras_config_errors_are_one_line_exits_too(override, line):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "eval.longbench_v2", override], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr


def test_a_typed_number_stays_a_number_where_any_shape_is_allowed():
    cfg = compose("needle", ["needle.answer=58213"])
    assert cfg.needle.answer == 58213


def test_a_new_key_still_composes_with_plus():
    cfg = compose("longbench", ["+longbench.new_knob=3"])
    assert cfg.longbench.new_knob == 3


@pytest.mark.parametrize("override, line", [
    ("model.dtype=float17", "model.dtype='float17' is not allowed; choose one of"),
    ("needle.scorer=bleu", "needle.scorer='bleu' is not allowed; choose one of recall"),
    ("needle.chat_format=chatml2", "needle.chat_format='chatml2' is not allowed"),
])
def test_a_value_outside_the_choices_is_a_one_line_exit_before_anything_runs(tmp_path, capsys, override, line):
    from eval.hydra_app import run_guarded
    cfg = compose("needle", ["model=tiny-llama", f"output_dir={tmp_path}", override])
    ran = []
    with pytest.raises(SystemExit) as exit_info:
        run_guarded(ran.append, cfg)
    assert exit_info.value.code == 2 and not ran
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {line}") and "\n" not in err
    assert not list(tmp_path.rglob("failed.json")), "nothing was claimed"


def test_other_tasks_sections_are_left_to_their_own_task():
    cfg = compose("longbench", ["+needle.scorer=bleu"])
    check_sections(cfg)
