"""Grouping a multirun's jobs for ``hydra/sweeper=shared_prefill`` (the sweeper itself lives in
``hydra_plugins/snapkv_bench_shared_prefill``, where Hydra finds plugins).

Jobs whose configs differ only in their compressor form one group. Compressor fields a method does
not read are dropped first (``full`` under three budgets is one setting, in the folder ``full``);
settings that land in one folder run once; each group's settings go to a JSON file that the job
reads (``shared_prefill.group``), named by its content so a rerun of the sweep reuses it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from snapkv.errors import InputError

GROUP_FOLDER = ".shared_prefill"
_DEFAULT_OUTPUT_DIR = "${hydra:runtime.output_dir}"
# Config nodes a member of a group may differ in (besides its compressor and folder); and
# ``shared_prefill.group``, which the sweeper itself sets.
_PER_SETTING = ("compressor", "output_dir", "hydra")


def unused_fields(method: str) -> set:
    """Fields of the compressor config group that ``method`` does not read (all of them for full)."""
    from snapkv import build_config
    from snapkv.registry import METHODS
    if method not in METHODS:
        build_config(method)  # fills the registry, or names the allowed methods
    cls = METHODS[method]
    used = {f.name for f in fields(cls)} - set(cls.derived) if cls().compresses else set()
    return {"budget", "ratio", "window", "kernel", "pooling", "gqa"} - used


@dataclass
class Member:
    overrides: list
    compressor: dict
    output_dir: str


def member_of(overrides: list, compose: Callable[[list], Any]) -> tuple[Member, str]:
    """The setting a job's overrides make and the key of everything else in its config."""
    cfg = compose(overrides)
    method = cfg.compressor.method
    dropped = unused_fields(method)
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in {f"compressor.{f}" for f in dropped}]
    if len(kept) != len(overrides):
        cfg = compose(kept)
    raw_out = OmegaConf.to_container(cfg, resolve=False).get("output_dir")
    if raw_out == _DEFAULT_OUTPUT_DIR:
        out = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
    else:
        out = Path(str(cfg.output_dir))
    compressor = OmegaConf.to_container(cfg.compressor, resolve=True)
    rest = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in _PER_SETTING}
    (rest.get("shared_prefill") or {}).pop("group", None)
    rest = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(rest)), resolve=True)
    return Member(kept, compressor, str(out.resolve())), json.dumps(rest, sort_keys=True, default=str)


def group_jobs(jobs: list[list[str]], compose: Callable[[list], Any]) -> list[list[Member]]:
    """Jobs grouped by everything but their compressor, in first-seen order; settings that land in
    one folder run once (two different settings in one folder are an error)."""
    groups: dict[str, dict[str, Member]] = {}
    for overrides in jobs:
        member, key = member_of(list(overrides), compose)
        folders = groups.setdefault(key, {})
        same = folders.get(member.output_dir)
        if same is None:
            folders[member.output_dir] = member
        elif same.compressor != member.compressor:
            raise InputError(f"two settings write {member.output_dir}: {' '.join(same.overrides)} and "
                             f"{' '.join(member.overrides)}; give them different compressor.tag values")
    return [list(folders.values()) for folders in groups.values()]


def write_group(sweep_dir: Path, members: list[Member]) -> Path:
    """The group's settings as the job reads them (named by their content: a rerun reuses it)."""
    body = {"settings": [{"compressor": m.compressor, "output_dir": m.output_dir, "overrides": m.overrides}
                         for m in members]}
    text = json.dumps(body, indent=1, sort_keys=True)
    folder = (sweep_dir / GROUP_FOLDER).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"group-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        partial = path.with_suffix(".partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    return path
