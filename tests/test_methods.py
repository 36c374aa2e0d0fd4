"""What every registered method must do (the list in ``tests/method_settings.py`` comes from
``snapkv.METHODS``): its Hydra option equals its dataclass, its run tag names every field that
changes what is kept, its label, its planner term, its budget semantics, one file per method."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import snapkv
from conftest import compose
from method_settings import COMPRESSING, REGISTERED, small
from snapkv.memory import Shape, plan
from snapkv.method import DECODING_FIELDS

METHODS_DIR = Path(snapkv.__file__).parent / "methods"
TINY = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2)


def option(method: str, *overrides: str) -> dict:
    from omegaconf import OmegaConf
    cfg = compose("longbench", [f"compressor={method}", *overrides])
    return OmegaConf.to_container(cfg.compressor, resolve=True)


@pytest.mark.parametrize("method", REGISTERED)
def test_the_config_option_is_the_dataclass(method):
    node = option(method)
    built = snapkv.build_config(node.pop("method"), **{k: v for k, v in node.items() if k != "tag"})
    cls = snapkv.METHODS[method]
    if method in COMPRESSING:
        assert built == cls()
    else:
        assert not built.compresses and node["tag"] == method


def test_the_generated_files_are_what_the_registry_generates():
    """The command-line contract names conf/compressor/<method>.yaml for the built-in methods; each
    file, each kvpress entry's option and the docs' method tables are what the registry generates
    (rewrite them with scripts/write_compressor_configs.py)."""
    from eval.compressor_configs import OPTIONS_DIR, generated_options
    from eval.method_tables import FILES, with_table
    for name in ("full", "snapkv", "h2o", "streamingllm", "pyramidkv"):
        assert (OPTIONS_DIR / f"{name}.yaml").exists(), name
    for name, text in generated_options().items():
        path = OPTIONS_DIR / name
        if path.exists():
            assert path.read_text(encoding="utf-8") == text, f"{path.name} drifted from the registry"
    for name, path in FILES.items():
        text = path.read_text(encoding="utf-8")
        assert with_table(text, name) == text, f"{path.name}: its method table drifted from the registry"
    for cls in snapkv.METHODS.values():
        assert cls.reference and (cls.budget_meaning or not cls().compresses), f"{cls.__name__}: no card"


def test_every_method_is_exported_under_its_class_name():
    for cls in snapkv.METHODS.values():
        assert cls.__name__ in snapkv.__all__ and getattr(snapkv, cls.__name__) is cls


@pytest.mark.parametrize("placement", ["agnostic", "aware"])
def test_the_leaderboard_presets_sweep_every_entry_the_registry_declares(placement):
    from eval import leaderboard
    path = leaderboard.PRESETS[placement]
    text = path.read_text(encoding="utf-8")
    assert leaderboard.with_preset_options(text, placement) == text, f"{path.name} drifted from the registry"
    declared = {press for cls in snapkv.METHODS.values() for press in cls.kvpress_entries}
    assert set(leaderboard.KVPRESS_NAMES.values()) == declared


@pytest.mark.parametrize("method", COMPRESSING)
def test_the_tag_changes_with_every_field_that_changes_what_is_kept(method):
    cls = snapkv.METHODS[method]
    base = option(method)
    changed = {"budget": 2048, "window": 16, "kernel": 3, "pooling": "avgpool", "gqa": "max", "accumulate": "float32",
               "seed": 1, "sink_tokens": 8, "beta": 10, "average": "kv_group", "scorer": "knorm",
               "alpha_safeguard": 0.5, "epsilon": 0.01, "first_stage_ratio": 0.25, "n_future_positions": 256,
               "n_sink": 8, "use_covariance": False, "use_vnorm": False, "allocation": "authors",
               "scorer_epsilon": 0.01, "chunk_size": 1024, "layerwise": True, "plus_normalization": True,
               "keep_prefix": True, "schedule": "kvpress",  # PyramidKV's kvpress schedule
               # LagKV, CUR, Compactor
               "lag_size": 64, "cross_scoring": True, "num_sinks": 8, "leverage_type": "kv_avg",
               "use_random_leverage": True, "use_local_approximation": False, "local_window_size": 32,
               "sink_size_start": 16, "sink_size_end": 8, "sketch_dimension": 32, "blending": 0.5,
               "chunk_length": 10, "block_size": 64,  # ChunkKV, Block
               "key_channel_ratio": 0.25,  # ThinK
               "normalize_scores": False, "rerotate_keys": False,  # FINCH
               "head_ratio": 0.25, "on_the_fly_scoring": True, "sink_size": 64, "recent_size": 128}  # DuoAttention
    alternatives = {"pooling": "maxpool"}  # where a method's default is the value above
    for f in dataclasses.fields(cls):
        if f.name in ("ratio", *cls.derived, *cls.untagged, *DECODING_FIELDS):
            continue
        assert f.name in changed, f"{method}.{f.name}: give this test a second value for it"
        value = changed[f.name] if changed[f.name] != f.default else alternatives[f.name]
        assert option(method, f"compressor.{f.name}={value}")["tag"] != base["tag"], f.name
    if "ratio" not in cls.derived:  # a method keeping every token (fewer key channels) takes no ratio
        assert option(method, "compressor.ratio=0.5")["tag"] != base["tag"]
    if not cls().cannot_decode():  # compression while decoding: each of its fields, once it is on
        on = option(method, "compressor.decode_target=4096")["tag"]
        assert on != base["tag"]
        for name, value in (("decode_interval", 64), ("decode_buffer", 8)):
            assert option(method, "compressor.decode_target=4096", f"compressor.{name}={value}")["tag"] != on, name
        assert option(method, "compressor.decode_ratio=0.5")["tag"] not in (on, base["tag"])


@pytest.mark.parametrize("method", REGISTERED)
def test_label_and_description(method):
    cfg = small(method)
    assert cfg.label().startswith(cfg.display_name) and cfg.display_name
    assert cfg.describe()["method"] == method
    assert set(cfg.describe()) == {"method"} | {f.name for f in dataclasses.fields(cfg)}


@pytest.mark.parametrize("method", REGISTERED)
def test_the_planner_has_a_term_for_every_method(method):
    cfg = small(method, budget=512, window=32)
    planned = plan(TINY, 8192, cfg if cfg.compresses else None)
    full = plan(TINY, 8192, None)
    if cfg.compresses:
        assert cfg.compression_bytes(Shape.of(TINY), 8192, 1, 2) > 0
        assert planned["kv_cache_bytes"] < full["kv_cache_bytes"]
    else:
        assert planned == full


@pytest.mark.parametrize("method", COMPRESSING)
@pytest.mark.parametrize("length", [100, 4096])
def test_every_layer_keeps_its_window_inside_its_budget(method, length):
    """Methods that rank every position (kvpress's Knorm, KeyDiff, Expected Attention) have no window."""
    cfg = small(method)
    for layer in range(4):
        budget = cfg.layer_budget(layer, 4, length)
        assert 0 <= cfg.recent_window(layer, 4, length) < budget


def test_one_method_a_file():
    """Each file of snapkv/methods/ defines and registers exactly one method, with a module docstring
    naming its source; the package imports every file (no list of names to keep)."""
    registered_in = {}
    for path in sorted(METHODS_DIR.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)
                   and any(getattr(d, "id", None) == "register" for d in node.decorator_list)]
        assert len(classes) == 1, f"{path.name}: {len(classes)} registered methods"
        assert ast.get_docstring(tree), f"{path.name}: no module docstring naming the method's source"
        registered_in[path.stem] = classes[0].name
    assert sorted(registered_in.values()) == sorted(cls.__name__ for cls in snapkv.METHODS.values())
    init = (METHODS_DIR / "__init__.py").read_text()
    assert not any(f".{name} import" in init or f"\"{name}\"" in init for name in registered_in)  # found, not listed
