"""What every Hydra task shares: run metadata, compressor building, failure handling."""
from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import snapkv

from .jsonl import append_record, write_json_atomic

CONFIG_PATH = str(Path(__file__).resolve().parent.parent / "conf")


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
        raise ValueError(f"{field} must be text (got {kind}); quote it if needed: {field}='...'")
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


def make_compressor(node) -> snapkv.CompressorConfig:
    return snapkv.build_config(node.method, **compressor_fields(node, keep_unset=True))


def resolve_device(cfg) -> str:
    from .runner import default_device
    device = cfg.get("device", "auto")
    return default_device() if device in (None, "auto") else device


def output_dir(cfg) -> Path:
    path = Path(cfg.output_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def _multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def run_guarded(task, cfg: DictConfig):
    """Run ``task(cfg)``. Bad input: one line on stderr and exit 2. In a sweep a failing job is
    recorded (``failed.json``) and reported at the end, and the other jobs go on."""
    try:
        return task(cfg)
    except (ValueError, FileNotFoundError) as exc:
        if _multirun():
            _record_failure(cfg, exc)
            return None
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:
        if _multirun():
            _record_failure(cfg, exc)
            return None
        raise


def _record_failure(cfg, exc: BaseException) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "failed.json", {"overrides": overrides, "error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc()})
    print(f"job failed ({' '.join(overrides)}): {type(exc).__name__}: {exc}", file=sys.stderr)


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
