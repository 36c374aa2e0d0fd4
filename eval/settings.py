"""Results belong to the settings that made them.

Every run folder holds ``settings.json``: the fingerprint of everything that can change an output, as
flat ``"section.field"`` keys. It is the whole config minus a list: every top-level field, every
field of the model section, of the compressor node and of the task's own section (``cfg.longbench``,
``cfg.needle``, ...), except the fields in ``HARMLESS`` (they cannot change an output: ``limit``,
``device``, the grid of a grid task, retries...) and those in ``DERIVED`` (the task fingerprints a
value derived from them instead, e.g. LongBench's data source for ``data_dir`` and ``revision``). A
task's own derived values (``PredictionTask.settings``) replace the raw fields of the same key
(``needle.haystack`` resolved to a folder, ``chat_format: null`` resolved to the model's). So a
field added to a config later counts unless it is put on one of the lists.

A rerun into the folder resumes only when its fingerprint is the same; otherwise it stops before
loading a model, naming each changed field, unless ``resume=restart`` moves the old results to a
dated folder beside the run. The left-out fields let a run be extended or moved to another machine.
"""
from __future__ import annotations

from snapkv.errors import InputError, check_choice

import json
import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf

from .jsonl import write_json_atomic

SETTINGS_FILE = "settings.json"
RESUME_MODES = ("auto", "restart")

# The sections of the tasks; a config holds the others' too (an experiment sets several), and only
# the running task's section counts.
TASK_SECTIONS = ("longbench", "longbench_v2", "ruler", "math", "needle", "lines", "observe", "bench", "report")
_GRID = ("lengths", "grid", "min_length", "max_length", "num_lengths", "depths", "num_depths")

# Fields that cannot change an output, by section ("": the top level).
HARMLESS = {
    "": ("device",          # where it runs (bench adds the resolved device itself: it changes its timings)
         "seed",            # read by nothing (the random method and the lines generator have their own)
         "resume", "lock_wait_s", "output_dir",
         "shared_prefill",  # group: each setting goes to the folder of its solo run (the engine adds
                            # decode_together itself where it changes a record)
         "query_aware",     # the engine adds it where false (folders made before it existed stay valid)
         "batch",           # the engine adds batch.items and batch.prefill where items are in flight
         "decoding",        # the engine adds decoding.* where it speculates (eval.speculation)
         "hydra"),          # Hydra's own node (in a composed config only)
    "model": ("name", "device_map", "mlp_chunk",  # mlp_chunk: the chunked MLP is exact
              "trained_context"),                 # a line on the needle heatmap
    "longbench": ("datasets",  # each dataset is its own file, its data checked by datasets.json
                  "limit", "retry_oom"),
    # a (length, task) is its own file and sample i does not depend on the count; export writes no results
    "ruler": ("tasks", "lengths", "samples", "export", "retry_oom"),
    # cot picks the prediction file (pred/0shot.jsonl or pred/0shot_cot.jsonl), like longbench.datasets
    "longbench_v2": ("limit", "retry_oom", "cot"),
    # problem i is row i of the data (whose digest counts), whatever the limit
    "math": ("limit", "retry_oom"),
    # cells are keyed by (length, depth) and do not depend on each other, so a grid can be extended
    "needle": _GRID + ("skip_after_oom", "retry_oom", "retry_failed", "dry_run", "memory_gib",
                       "full_kv_frontier"),  # the heatmap's dashed line
    "lines": _GRID + ("skip_after_oom", "retry_oom", "retry_failed"),
    "observe": ("limit",),
    # bench rows are keyed by (method, budget, length, batch); a timing is the median of its repeats;
    # plan, plan_lengths and sweep (which claims no folder) write no rows; frontier picks the result
    # file; the frontier search's start, cap and probe time limit are not counted (as before)
    "bench": ("lengths", "budgets", "methods", "batch_sizes", "repeats", "prefill_repeats", "plan", "measure",
              "plan_lengths",
              "sweep", "frontier", "frontier_start", "frontier_max", "probe_timeout_s"),
}
# Fields that change an output but count through a value the task derives from them (its settings).
DERIVED = {
    "longbench": ("data_dir", "revision"),              # longbench.data_source
    "longbench_v2": ("data_file", "revision"),          # longbench_v2.data_source
    "math": ("data", "revision"),                       # math.data_source and math.data_sha256
    "needle": ("needle", "answer", "extra_needles"),    # needle.needles
    "bench": ("memory_gib", "frontier_min", "frontier_resolution"),  # added by bench with frontier=true
}
# Model fields recorded even when unset (null), as every settings.json has had them.
MODEL_FIELDS = ("path", "revision", "package_file", "tokenizer", "use_fast_tokenizer", "dtype",
                "attn_implementation", "max_length", "chat_format", "protocol", "random_init", "architecture")
# Kept in the folder: Hydra's own files of the current job, and the run lock this process holds.
_KEPT_ENTRIES = (".hydra", ".lock")


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def left_out(section: str) -> set[str]:
    return set(HARMLESS.get(section, ())) | set(DERIVED.get(section, ()))


def section_settings(node, section: str) -> dict:
    """Every field of a config section but the left-out ones, as ``{"section.field": value}``."""
    if node is None:
        return {}
    skip = left_out(section)
    return {f"{section}.{name}": _plain(node[name]) for name in node if name not in skip}


def top_level_settings(cfg) -> dict:
    skip = left_out("") | {"model", "compressor", *TASK_SECTIONS}
    return {name: _plain(cfg[name]) for name in cfg if name not in skip}


def model_settings(model_cfg) -> dict:
    from .runner import attn_implementation
    out = {f"model.{name}": None for name in MODEL_FIELDS}
    out.update(section_settings(model_cfg, "model"))
    out["model.attn_implementation"] = attn_implementation(model_cfg)  # sdpa where flash-attn cannot run
    if not model_cfg.get("random_init"):
        out["model.architecture"] = None  # only describes the weights of a random-init model
    return out


def compressor_settings(node, skip=("tag",)) -> dict:
    fields = OmegaConf.to_container(node, resolve=True)
    return {f"compressor.{k}": v for k, v in sorted(fields.items()) if k not in skip}


def fingerprint(cfg, derived: dict | None = None, compressor_skip=("tag",)) -> dict:
    """The flat ``{"section.field": value}`` settings of one run: the top-level fields, the model
    section, the compressor node (but ``compressor_skip``) and the task's section, less the left-out
    fields (``HARMLESS``, ``DERIVED``), then ``derived``: the task's values that replace raw fields."""
    compressor = compressor_settings(cfg.compressor, compressor_skip) if cfg.get("compressor") is not None else {}
    return {**top_level_settings(cfg), **model_settings(cfg.model), **compressor,
            **section_settings(cfg.get(cfg.task), cfg.task), **{k: _plain(v) for k, v in (derived or {}).items()}}


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
    check_choice("resume", resume, RESUME_MODES)
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
    elif old is not None and changed_fields(old, settings):  # a field added later, unset, equals its absence
        changes = "; ".join(changed_fields(old, settings))
        raise InputError(f"output_dir={out} holds results made with other settings ({changes}); pass "
                         "resume=restart (moves them to a dated folder beside it) or another output_dir")
    if old is None:
        write_json_atomic(path, settings)
