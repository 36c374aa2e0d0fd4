"""Append-only JSONL result files that survive interruption and resume without duplicates."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Complete records of ``path``; a half-written last line (a crash mid-write) is cut off.

    Records are written whole with their newline, so only the text after the last newline can
    be a partial write. A malformed line before it is an error naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    *complete, tail = raw.split(b"\n")
    records = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: malformed result line ({exc}); fix or delete it") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a result line must be a JSON object")
        records.append(record)
    if tail:
        with path.open("r+b") as f:
            f.truncate(len(raw) - len(tail))
    return records


def append_record(path: Path, record: dict) -> None:
    """Append one line and push it to disk before returning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
