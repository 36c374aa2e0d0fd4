"""LongBench v2 data: the official ``data.json`` (the hub, or a local copy), every row validated."""
from __future__ import annotations

import json
from pathlib import Path

from ..jsonl import input_lines
from ..longbench.data import file_digest, hub_dataset_file  # noqa: F401  (file_digest: re-exported for the task)
from snapkv.errors import InputError

HUB_REPO, HUB_FILE = "THUDM/LongBench-v2", "data.json"
CHOICES = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
# every field pred.py copies from a row (``data_all``), all strings
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question",
          "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")
_ALLOWED = {"difficulty": DIFFICULTIES, "length": LENGTHS, "answer": CHOICES}


def validate_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be a JSON object")
    for name in FIELDS:
        if name not in row:
            raise InputError(f"{where}: missing field {name!r}")
        if not isinstance(row[name], str):
            raise InputError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
    for name, allowed in _ALLOWED.items():
        if row[name] not in allowed:
            raise InputError(f"{where}: field {name!r} is {row[name]!r}; allowed: {', '.join(allowed)}")
    return row


def _objects(path: Path):
    """``(where, object)`` of a JSON array file (``data.json``) or a JSONL file."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        for number, row in enumerate(data, start=1):
            yield f"{path} row {number}", row
    else:
        yield from input_lines(path)


def read_rows(path: Path) -> list[dict]:
    """The rows of ``path`` in file order; a bad or duplicate row is an error naming where it is."""
    rows, seen = [], {}
    for where, row in _objects(Path(path)):
        row = validate_row(row, where)
        if row["_id"] in seen:
            raise InputError(f"{where}: duplicate _id {row['_id']!r} (first at {seen[row['_id']]})")
        seen[row["_id"]] = where
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def data_source(data_file: str | None, revision: str) -> str:
    """What the settings fingerprint records about where the rows come from."""
    return str(Path(data_file).resolve()) if data_file else f"hub:{HUB_REPO}@{revision}"


def data_path(data_file: str | None, revision: str = "main") -> Path:
    """The local ``data_file``, or the hub's ``data.json`` at ``revision`` (downloaded once into the
    Hugging Face cache; a cached copy serves offline)."""
    if data_file:
        path = Path(data_file)
        if not path.is_file():
            raise InputError(f"longbench_v2.data_file={data_file}: no such file (expected the official data.json "
                             f"of {HUB_REPO}, or JSONL rows with its fields)")
        return path
    return Path(hub_dataset_file(HUB_REPO, HUB_FILE, revision, "longbench_v2.revision",
                                 "no LongBench v2 data: offline or the hub is unreachable ({error}); download "
                                 f"{HUB_FILE} of https://huggingface.co/datasets/{HUB_REPO} (revision {revision}) "
                                 "and pass longbench_v2.data_file=FILE"))
