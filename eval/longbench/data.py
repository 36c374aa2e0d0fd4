"""LongBench v1 / LongBench-E data: find the JSONL files, validate every row."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from ..jsonl import input_lines
from ..runner import cache_root
from snapkv.errors import InputError

PAPER_DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                  "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                  "passage_retrieval_en", "lcc", "repobench-p")
V1_DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa",
               "musique", "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa",
               "samsum", "lsht", "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc",
               "repobench-p")
E_DATASETS = tuple(f"{d}_e" for d in ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report",
                                      "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                                      "passage_retrieval_en", "lcc", "repobench-p"))
ALL_DATASETS = V1_DATASETS + E_DATASETS

_FIELDS = {"input": str, "context": str, "answers": list, "length": int, "dataset": str,
           "language": str, "_id": str}
HUB_REPO, HUB_FILE = "THUDM/LongBench", "data.zip"


def check_dataset(name: str) -> str:
    if name not in ALL_DATASETS:
        raise InputError(f"longbench.datasets: {name!r} is not a LongBench dataset; allowed: {', '.join(ALL_DATASETS)}")
    return name


def validate_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be a JSON object")
    for name, kind in _FIELDS.items():
        if name not in row:
            raise InputError(f"{where}: missing field {name!r}")
        if not isinstance(row[name], kind) or (kind is int and isinstance(row[name], bool)):
            raise InputError(f"{where}: field {name!r} must be {kind.__name__}, got {type(row[name]).__name__}")
    if not all(isinstance(a, str) for a in row["answers"]):
        raise InputError(f"{where}: field 'answers' must be a list of strings")
    classes = row.get("all_classes", "missing")
    if classes == "missing":
        raise InputError(f"{where}: missing field 'all_classes' (null where the dataset has none)")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise InputError(f"{where}: field 'all_classes' must be null or a list of strings")
    return row


def read_dataset(path: Path) -> list[dict]:
    rows, seen = [], {}
    for where, row in input_lines(path):
        row = validate_row(row, where)
        if row["_id"] in seen:
            raise InputError(f"{where}: duplicate _id {row['_id']!r} (first on line {seen[row['_id']]})")
        seen[row["_id"]] = where.rsplit(":", 1)[1]
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def data_source(data_dir: str | None, revision: str) -> str:
    """What the settings fingerprint records about where the rows come from."""
    return str(Path(data_dir).resolve()) if data_dir else f"hub:{HUB_REPO}@{revision}"


def _is_offline(exc: BaseException) -> bool:
    """A network failure (no route, DNS, refused, timed out), not an error the hub answered with."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    names = {type(e).__name__ for e in _causes(exc)}
    return bool(names & {"ConnectError", "ConnectTimeout", "ConnectionError", "Timeout", "ReadTimeout",
                         "NameResolutionError", "MaxRetryError"})


def _causes(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _unpack(archive: str, target: Path) -> None:
    """Unpack into a temporary folder beside ``target`` and rename it into place (no half-unpacked data)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "data").is_dir():  # not a concurrent job that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hub_dataset_file(repo: str, filename: str, revision: str, revision_field: str, offline_message: str) -> str:
    """A file of a hub dataset at ``revision`` (downloaded once into the Hugging Face cache; a cached
    copy serves offline). Offline: ``offline_message`` (``{error}``: the exception's type); a refusal
    by the hub names ``revision_field``."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download(repo, filename, repo_type="dataset", revision=revision)
    except Exception as exc:
        if _is_offline(exc):
            raise InputError(offline_message.format(error=type(exc).__name__)) from None
        raise InputError(f"{revision_field}={revision!r}: the hub refused {repo}/{filename} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def _hub_data_dir(revision: str) -> Path:
    """The official ``data.zip`` at ``revision``, downloaded once and unpacked into our cache."""
    target = cache_root() / "longbench" / revision
    if (target / "data").is_dir():
        return target / "data"
    archive = hub_dataset_file(HUB_REPO, HUB_FILE, revision, "longbench.revision",
                               "no LongBench data: offline or the hub is unreachable ({error}); download data.zip "
                               f"of https://huggingface.co/datasets/{HUB_REPO} (revision {revision}), unpack it and "
                               "pass longbench.data_dir=DIR")
    _unpack(archive, target)
    return target / "data"


def dataset_file(name: str, data_dir: str | None, revision: str = "main") -> Path:
    check_dataset(name)
    if data_dir:
        folder = Path(data_dir)
        for candidate in (folder / f"{name}.jsonl", folder / "data" / f"{name}.jsonl"):
            if candidate.exists():
                return candidate
        raise InputError(f"longbench.data_dir={data_dir}: no {name}.jsonl there (expected the unpacked "
                         f"official data.zip of {HUB_REPO}, one <dataset>.jsonl a dataset)")
    folder = _hub_data_dir(revision)
    path = folder / f"{name}.jsonl"
    if not path.exists():
        raise InputError(f"{folder}: the unpacked {HUB_FILE} has no {name}.jsonl")
    return path
