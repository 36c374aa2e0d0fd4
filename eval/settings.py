"""Results belong to the settings that made them.

Every run folder holds ``settings.json``: the fingerprint of everything that can change an output
(model weights and numerics, prompt rules, every compressor field, the task fields that shape a
result). A rerun into the folder resumes only when its fingerprint is the same; otherwise it stops
before loading a model, naming each changed field, unless ``resume=restart`` moves the old results
to a dated folder beside the run. Fields that cannot change an output (``limit``, ``device``,
progress bars) are left out, so a run can be extended or moved to another machine.
"""
from __future__ import annotations

from snapkv.config import InputError

import json
import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf

from .jsonl import write_json_atomic

SETTINGS_FILE = "settings.json"
RESUME_MODES = ("auto", "restart")

# Model-config fields that change what a model outputs. ``name``, ``device_map`` and ``mlp_chunk``
# (exact) do not.
MODEL_FIELDS = ("path", "revision", "package_file", "tokenizer", "use_fast_tokenizer", "dtype",
                "attn_implementation", "max_length", "chat_format", "protocol", "random_init", "architecture")
# Kept in the folder: Hydra's own files of the current job, and the run lock this process holds.
_KEPT_ENTRIES = (".hydra", ".lock")


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def model_settings(model_cfg) -> dict:
    from .runner import attn_implementation
    out = {}
    for name in MODEL_FIELDS:
        value = _plain(model_cfg.get(name)) if name != "attn_implementation" else attn_implementation(model_cfg)
        if name == "architecture" and not model_cfg.get("random_init"):
            value = None  # only describes the weights of a random-init model
        out[f"model.{name}"] = value
    return out


def compressor_settings(node, skip=("tag",)) -> dict:
    fields = OmegaConf.to_container(node, resolve=True)
    return {f"compressor.{k}": v for k, v in sorted(fields.items()) if k not in skip}


def fingerprint(cfg, task_fields: dict, compressor_skip=("tag",)) -> dict:
    """The flat ``{"section.field": value}`` settings of one run."""
    compressor = compressor_settings(cfg.compressor, compressor_skip) if cfg.get("compressor") is not None else {}
    return {"task": cfg.task, **model_settings(cfg.model), **compressor,
            **{k: _plain(v) for k, v in task_fields.items()}}


def _show(value) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)


def changed_fields(old: dict, new: dict) -> list[str]:
    return [f"{k} {_show(old.get(k))} -> {_show(new.get(k))}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _has_results(out: Path, result_names) -> bool:
    return any((out / name).exists() for name in result_names)


def move_aside(out: Path) -> Path:
    """Move a run folder's contents (but Hydra's own files of this job) to ``<folder>.<date-time>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out.with_name(f"{out.name}.{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = out.with_name(f"{out.name}.{stamp}-{n}")
    target.mkdir(parents=True)
    for entry in out.iterdir():
        if entry.name in _KEPT_ENTRIES or entry.suffix == ".log":
            continue
        shutil.move(str(entry), str(target / entry.name))
    return target


def claim(out: Path, settings: dict, resume: str, result_names) -> None:
    """Make ``out`` a folder of ``settings``' results, or stop with one line saying why not."""
    if resume not in RESUME_MODES:
        raise InputError(f"resume={resume!r} is not allowed; choose one of {', '.join(RESUME_MODES)}")
    settings = json.loads(json.dumps(settings))  # compare as it reads back (tuples become lists)
    path = out / SETTINGS_FILE
    old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    occupied = old is not None or _has_results(out, result_names)
    if occupied and resume == "restart":
        moved = move_aside(out)
        print(f"resume=restart: the previous results of {out} are now in {moved}")
        old = None
    elif old is None and occupied:
        raise InputError(f"output_dir={out} holds results without {SETTINGS_FILE} (an older version made them), "
                         "so they cannot be checked against these settings; pass resume=restart (moves them to "
                         "a dated folder beside it) or another output_dir")
    elif old is not None and old != settings:
        changes = "; ".join(changed_fields(old, settings))
        raise InputError(f"output_dir={out} holds results made with other settings ({changes}); pass "
                         "resume=restart (moves them to a dated folder beside it) or another output_dir")
    if old is None:
        write_json_atomic(path, settings)
