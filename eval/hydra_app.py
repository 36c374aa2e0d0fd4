"""What every Hydra task shares: run metadata, compressor building, failure handling."""
from __future__ import annotations

from snapkv.errors import InputError

import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
import functools
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import snapkv

from .jsonl import append_record, write_json_atomic
from .runlock import run_lock
from .sections import check_sections

CONFIG_PATH = str(Path(__file__).resolve().parent.parent / "conf")
# Exit statuses: bad input of the whole command (one line on stderr; a single run's bad input too),
# and a multirun with at least one failed job (after the summary of its failures).
EXIT_BAD_INPUT = 2
EXIT_JOBS_FAILED = 1
# The id of the multirun a job belongs to, set by the submitting process (``ReportFailures``) and
# inherited by its jobs (the basic launcher's are in the same process; sbatch exports the environment).
SWEEP_ENV = "SNAPKV_BENCH_SWEEP"
# A job's failure record from its start: a job killed before it can say why (SIGKILL after the
# scheduler's grace period, the OOM killer, a node failure) still leaves one.
UNFINISHED = ("did not finish: killed (scancel or preemption past the grace period, a time limit, the host's OOM "
              "killer, a node failure) or still running")


def task_main(config_name: str):
    """``hydra.main`` for a task's app. Hydra's own config errors (a value of the wrong type, an
    unknown key, a missing config option, an override it cannot parse) and the sweeper's input checks
    print one line and exit 2, as the project's input checks do; any other exception keeps its
    traceback. A multirun with a failed job exits 1 after its summary (``ReportFailures``)."""
    def decorate(task_function):
        hydra_entry = hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(task_function)

        @functools.wraps(task_function)
        def entry():
            global _SWEEP
            _SWEEP = None
            previous = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
            try:
                result = hydra_entry()
            except (ConfigCompositionException, OverrideParseException) as exc:
                _report_sweep()  # a swept value that does not compose stops a sweep at its job
                print(f"error: {config_error_line(exc)}", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            except InputError as exc:  # the whole command's input, checked outside a job (e.g. by the sweeper)
                _report_sweep()
                print(f"error: {exc}", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            except Exception:  # a launcher that gave up (a SLURM job killed outright): what failed, then why
                _report_sweep()
                raise
            finally:
                os.environ.pop(SWEEP_ENV, None)
                if previous is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = previous
            if _SWEEP is not None and _SWEEP.failed:
                sys.exit(EXIT_JOBS_FAILED)
            return result
        return entry
    return decorate


def config_error_line(exc: Exception) -> str:
    """Hydra's multi-line message (and OmegaConf's cause under it) as one line: the override, what
    is wrong with it, the options where Hydra lists them."""
    text = str(exc).replace("Error merging override ", "").split("\nConfig search path")[0]
    if isinstance(exc, OverrideParseException) and exc.override:
        text = f"{exc.override}: {text}"
    if exc.__cause__ is not None:
        cause = str(exc.__cause__).splitlines()
        text += ": " + cause[0] if cause else ""
    parts: list[str] = []
    for line in text.splitlines():
        item = line.startswith("\t")
        line = line.strip()
        if not line:
            continue
        if item and parts:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        else:
            parts.append(line.rstrip("."))
    return "; ".join(parts)


def compressor_fields(node, keep_unset: bool = False) -> dict:
    """A compressor config node's method fields (without ``method`` and ``tag``; unset ones dropped
    unless ``keep_unset``, so that a method's own field set to null is still validated)."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()
            if k not in ("method", "tag") and (keep_unset or v is not None)}


def typed_text(value, field: str) -> str:
    """A text field as the user typed it. Hydra types ``needle.answer=58213`` as an int and
    ``=3.10`` as the float 3.1, so the raw override is read back when there is one; a list or a
    mapping where text is expected is an error naming the field."""
    if isinstance(value, str):
        return value
    if value is None or OmegaConf.is_config(value) or isinstance(value, (list, dict, tuple)):
        kind = "nothing" if value is None else "a list or mapping"
        raise InputError(f"{field} must be text (got {kind}); quote it if needed: {field}='...'")
    raw = _raw_override(field)
    if raw is not None:
        return raw
    return str(value).lower() if isinstance(value, bool) else str(value)


def _raw_override(field: str) -> str | None:
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:  # not inside a Hydra app (e.g. a test composing the config)
        return None
    for override in overrides:
        key, sep, raw = override.partition("=")
        if sep and key.lstrip("+~") == field:
            raw = raw.strip()
            if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
                raw = raw[1:-1]
            return raw
    return None


def make_compressor(node) -> snapkv.Method:
    return snapkv.build_config(node.method, **compressor_fields(node, keep_unset=True))


def resolve_device(cfg) -> str:
    from .runner import default_device
    device = cfg.get("device", "auto")
    return default_device() if device in (None, "auto") else device


def output_dir(cfg) -> Path:
    path = Path(cfg.output_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_group(cfg) -> list[dict] | None:
    """The settings of a ``shared_prefill`` group job (``[{compressor, output_dir, overrides}]``), or
    None for a job of one setting."""
    node = cfg.get("shared_prefill")
    group = node.get("group") if node is not None else None
    if not group:
        return None
    path = Path(str(group))
    if not path.is_file():
        raise InputError(f"shared_prefill.group={group}: no such file (hydra/sweeper=shared_prefill writes it)")
    return json.loads(path.read_text(encoding="utf-8"))["settings"]


def job_output_dirs(cfg) -> list[Path]:
    """Every folder a job writes: one per setting."""
    return [out for out, _ in job_settings(cfg)]


def save_run_metadata(cfg, out: Path, compressor, extra: dict | None = None) -> None:
    """``config.yaml`` and ``compressor.json`` of the run that made the folder (never overwritten:
    later invocations resume the same settings, see ``eval.settings``); ``versions.json`` of the
    latest invocation; one line per invocation in ``invocations.jsonl``."""
    import torch
    import transformers
    if not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
        write_json_atomic(out / "compressor.json", compressor.describe())
    versions = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "snapkv_bench": _own_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
    }
    write_json_atomic(out / "versions.json", versions)
    append_record(out / "invocations.jsonl", {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                              "argv": sys.argv[1:], "device": cfg.get("device"),
                                              **(extra or {}), **versions})


def _own_version() -> str:
    try:
        from importlib.metadata import version
        return version("snapkv-bench")
    except Exception:
        return "unknown"


def drop_full_kv_sizes(cfg: DictConfig) -> None:
    """Full KV keeps every token: a budget, ratio or other compressor field given to it (a plain multirun
    ``compressor=full,snapkv compressor.budget=256,512``) is dropped with a note, as the shared-prefill
    sweeper drops it, so that each such job is the one full run (the same folder and fingerprint: the
    first writes it, the others find it done)."""
    node = cfg.get("compressor")
    if node is None or node.get("method") != "full":
        return
    from .sweep_groups import unused_fields
    given = sorted(name for name in unused_fields("full") if node.get(name) is not None)
    if given:
        print(f"note: compressor=full keeps every token; {', '.join(f'compressor.{n}' for n in given)} ignored")
        for name in given:
            node[name] = None


def _multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def run_guarded(task, cfg: DictConfig):
    """Run ``task(cfg)`` holding the lock of every folder the job writes (a shared-prefill group
    writes one per setting). Bad input (``InputError``, the project's own checks): one line on
    stderr and exit 2; any other exception keeps its traceback and exit status. In a sweep a failing job is
    recorded (``failed.json`` in each of its folders, with the overrides of the setting that writes
    it) and reported at the end, and the other jobs go on; a job the scheduler cancels (SIGTERM)
    records that too, and a job killed outright keeps the record every job writes when it starts
    (``UNFINISHED``). A finished job leaves no failure record, so only current failures are listed.
    The model and the CUDA cache are freed after each job (Hydra's basic launcher runs a sweep's jobs
    one after another in one process)."""
    settings: list[tuple[Path, list[str]]] = []
    claimed = False
    try:
        drop_full_kv_sizes(cfg)
        check_sections(cfg)
        settings = job_settings(cfg)
        with _on_sigterm(settings), ExitStack() as locks:
            for out in sorted({out for out, _ in settings}):
                locks.enter_context(run_lock(out, cfg.get("lock_wait_s", 0)))
            for out, overrides in settings:  # replaced by the real reason on a failure, removed when the job finishes
                _write_failure(out, overrides, UNFINISHED, None)
            claimed = True
            result = task(cfg)
        for out, _ in settings:
            clear_failure(out)
        _clear_fallback_record(settings)
        return result
    except InputError as exc:
        if _multirun():
            _record_failure(settings, exc)
            return None
        if claimed:
            _record_failure(settings, exc, say=False)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except Exception as exc:
        if _multirun():
            _record_failure(settings, exc)
            return None
        if claimed:
            _record_failure(settings, exc, say=False)
        raise
    finally:
        from .runner import free_memory
        free_memory()


def job_settings(cfg) -> list[tuple[Path, list[str]]]:
    """Every folder a job writes with the overrides of the setting that writes it. A shared-prefill
    group's settings each keep their own (the overrides of the job the sweep made for that setting:
    the group's with that setting's ``compressor.*``), so a failure names each setting as a solo run
    of it is typed."""
    if cfg.get("task") == "report" or not cfg.get("output_dir"):
        return []
    members = shared_group(cfg)
    if not members:
        return [(Path(cfg.output_dir), _overrides())]
    group = [o for o in _overrides() if o.split("=", 1)[0].lstrip("+~") != "shared_prefill.group"]
    return [(Path(m["output_dir"]), list(m.get("overrides") or group)) for m in members]


@contextmanager
def _on_sigterm(settings: list[tuple[Path, list[str]]]):
    """While a job runs, SIGTERM (scancel, preemption, the end of a time limit) writes its failure
    records before the previous handler runs (submitit's, which lets the job be killed or requeued)."""
    if not settings or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        for out, overrides in settings:
            _write_failure(out, overrides, "cancelled or preempted: SIGTERM from the scheduler or the system", None)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return sys.argv[1:]


def _fallback_dir() -> Path | None:
    """Where a sweep job that failed before it knew its folders records the failure: Hydra's job
    directory (the folder its settings would write with the default ``output_dir``)."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except (ValueError, AttributeError, TypeError):
        return None


def _write_failure(out: Path, overrides: list[str], error: str, trace: str | None) -> None:
    """``failed.json`` in ``out``: the setting's overrides, why, and which sweep's job wrote it
    (``sweep``: the id its submitting process set, so that its summary counts its own jobs only)."""
    multirun = _multirun()
    info = {"overrides": list(overrides), "error": error, "traceback": trace,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "multirun": multirun, "sweep": os.environ.get(SWEEP_ENV) if multirun else None}
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "failed.json", info)
    if _SWEEP is not None and multirun:
        _SWEEP.here[str(out.resolve())] = info


def _record_failure(settings: list[tuple[Path, list[str]]], exc: BaseException, say: bool = True) -> None:
    error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    if not settings and _multirun() and _fallback_dir() is not None:
        settings = [(_fallback_dir(), _overrides())]
    for out, overrides in settings:
        _write_failure(out, overrides, error, trace)
    if not say:
        return
    if len(settings) > 1:  # a shared-prefill group: what its settings share (the summary names each)
        common = [o for o in settings[0][1] if all(o in overrides for _, overrides in settings)]
        what = f"shared-prefill group of {len(settings)} settings: {' '.join(common)}"
    else:
        what = " ".join(settings[0][1] if settings else _overrides())
    print(f"job failed ({what}): {error}", file=sys.stderr)


def clear_failure(out: Path) -> None:
    (out / "failed.json").unlink(missing_ok=True)
    if _SWEEP is not None:
        _SWEEP.here.pop(str(Path(out).resolve()), None)


def _clear_fallback_record(settings: list[tuple[Path, list[str]]]) -> None:
    """A finished job also removes the record it left, when it failed before it knew its folders,
    in its Hydra job directory (when that is not one of its folders)."""
    folder = _fallback_dir() if _multirun() else None
    if folder is None or any(folder.resolve() == out.resolve() for out, _ in settings):
        return
    try:
        info = json.loads((folder / "failed.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if info.get("overrides") == _overrides():
        clear_failure(folder)


@dataclass
class _Sweep:
    """The multirun this process submitted: its id (``SWEEP_ENV``), its sweep directory, the failure
    records there when it started (a record from an earlier sweep that this one did not rewrite is
    not its failure), the records its jobs in this process wrote, and at the end its failures."""
    id: str
    root: Path
    before: dict
    here: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    reported: bool = False

    def current_failures(self) -> dict:
        found = {}
        for path in _failure_files(self.root):
            try:
                info, stamp = json.loads(path.read_text(encoding="utf-8")), _stamp(path)
            except (OSError, ValueError):
                continue
            sweep = info.get("sweep")
            # this sweep's job; or, where a job could not tell its sweep (its launcher passed no
            # environment), a sweep job's record written or rewritten since this sweep started
            rewritten = self.before.get(str(path)) != stamp
            if sweep == self.id or (sweep is None and info.get("multirun", True) and rewritten):
                found[str(path.parent.resolve())] = info
        for folder, info in self.here.items():  # a folder outside the sweep directory (output_dir=...)
            found.setdefault(folder, info)
        return found


_SWEEP: _Sweep | None = None


def _failure_files(root: Path) -> list[Path]:
    return sorted(root.rglob("failed.json")) if root.is_dir() else []


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def _report_sweep() -> None:
    """Once per multirun, after its jobs (or when its launcher gave up): each failed job of this
    sweep with its overrides, one line each; the app then exits ``EXIT_JOBS_FAILED``."""
    sweep = _SWEEP
    if sweep is None or sweep.reported:
        return
    sweep.reported = True
    os.environ.pop(SWEEP_ENV, None)
    sweep.failed = sweep.current_failures()
    if not sweep.failed:
        return
    print(f"\n{len(sweep.failed)} job(s) failed:", file=sys.stderr)
    for _, info in sorted(sweep.failed.items()):
        print(f"  {' '.join(info.get('overrides') or []) or '(no overrides)'}: {info.get('error')}", file=sys.stderr)
    print(f"(the traceback of each: failed.json in its folder; exit status {EXIT_JOBS_FAILED})", file=sys.stderr)


class ReportFailures(Callback):
    """At the end of a sweep, list the jobs of this sweep that failed with their overrides (a
    shared-prefill group's settings each with their own); the app then exits 1. Runs in the process
    that submitted the sweep and reads the ``failed.json`` files under ``hydra.sweep.dir``, so it
    works with every launcher (the SLURM jobs write them on the shared file system)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _SWEEP
        root = Path(str(config.hydra.sweep.dir)).resolve()
        _SWEEP = _Sweep(uuid.uuid4().hex, root, {str(p): _stamp(p) for p in _failure_files(root)})
        os.environ[SWEEP_ENV] = _SWEEP.id

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        _report_sweep()
