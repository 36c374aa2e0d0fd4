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
from contextlib import ExitStack, contextmanager
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
# A job's failure record from its start: a job killed before it can say why (SIGKILL after the
# scheduler's grace period, the OOM killer, a node failure) still leaves one.
UNFINISHED = ("did not finish: killed (scancel or preemption past the grace period, a time limit, the host's OOM "
              "killer, a node failure) or still running")


def task_main(config_name: str):
    """``hydra.main`` for a task's app. Hydra's own config errors (a value of the wrong type, an
    unknown key, a missing config option, an override it cannot parse) print one line and exit 2, as
    the project's input checks do; any other exception keeps its traceback."""
    def decorate(task_function):
        hydra_entry = hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(task_function)

        @functools.wraps(task_function)
        def entry():
            previous = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
            try:
                return hydra_entry()
            except (ConfigCompositionException, OverrideParseException) as exc:
                print(f"error: {config_error_line(exc)}", file=sys.stderr)
                sys.exit(2)
            finally:
                if previous is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = previous
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
    if cfg.get("task") == "report" or not cfg.get("output_dir"):
        return []
    members = shared_group(cfg)
    return [Path(m["output_dir"]) for m in members] if members else [Path(cfg.output_dir)]


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
    recorded (``failed.json`` in each of its folders) and reported at the end, and the other jobs go
    on; a job the scheduler cancels (SIGTERM) records that too, and a job killed outright keeps the
    record every job writes when it starts (``UNFINISHED``). A finished job leaves no failure record,
    so only current failures are listed. The model and the CUDA cache are freed after each
    job (Hydra's basic launcher runs a sweep's jobs one after another in one process)."""
    outs: list[Path] = []
    try:
        drop_full_kv_sizes(cfg)
        check_sections(cfg)
        outs = job_output_dirs(cfg)
        with _on_sigterm(outs), ExitStack() as locks:
            for out in sorted(set(outs)):
                locks.enter_context(run_lock(out, cfg.get("lock_wait_s", 0)))
            for out in outs:  # replaced by the real reason on a failure, removed when the job finishes
                _write_failure(out, UNFINISHED, None)
            result = task(cfg)
        for out in outs:
            clear_failure(out)
        return result
    except InputError as exc:
        if _multirun():
            _record_failure(outs, exc)
            return None
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:
        if _multirun():
            _record_failure(outs, exc)
            return None
        raise
    finally:
        from .runner import free_memory
        free_memory()


@contextmanager
def _on_sigterm(outs: list[Path]):
    """While a job runs, SIGTERM (scancel, preemption, the end of a time limit) writes its failure
    records before the previous handler runs (submitit's, which lets the job be killed or requeued)."""
    if not outs or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        for out in outs:
            _write_failure(out, "cancelled or preempted: SIGTERM from the scheduler or the system", None)
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


def _write_failure(out: Path, error: str, trace: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "failed.json", {"overrides": _overrides(), "error": error, "traceback": trace,
                                            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "slurm_job": os.environ.get("SLURM_JOB_ID")})


def _record_failure(outs: list[Path], exc: BaseException) -> None:
    for out in outs:
        _write_failure(out, f"{type(exc).__name__}: {exc}", traceback.format_exc())
    print(f"job failed ({' '.join(_overrides())}): {type(exc).__name__}: {exc}", file=sys.stderr)


def clear_failure(out: Path) -> None:
    (out / "failed.json").unlink(missing_ok=True)


class ReportFailures(Callback):
    """At the end of a sweep, list the jobs that failed with their overrides."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        root = Path(config.hydra.sweep.dir)
        failures = sorted(root.rglob("failed.json"))
        if not failures:
            return
        print(f"\n{len(failures)} job(s) failed:", file=sys.stderr)
        for path in failures:
            info = json.loads(path.read_text())
            print(f"  {' '.join(info['overrides']) or '(no overrides)'}: {info['error']}", file=sys.stderr)
