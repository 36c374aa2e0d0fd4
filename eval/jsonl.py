"""Append-only JSONL result files that survive interruption and resume without duplicates."""
from __future__ import annotations

import json
import os
from pathlib import Path
from snapkv.errors import InputError


def read_records(path: Path, repair: bool = False) -> list[dict]:
    """Complete records of ``path``. Reading never changes the file unless ``repair``.

    Records are written whole with their newline, so only the text after the last newline can
    be a partial write (a crash mid-write). If that text parses, it is a record (a file made
    elsewhere may lack the final newline); if not, ``repair`` (the writer resuming its own file)
    cuts it off, and a reader stops with an error naming the file and line. A malformed line
    before it is always an error naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    *complete, tail = raw.split(b"\n")
    records = [_parse(path, number, line) for number, line in enumerate(complete, start=1) if line.strip()]
    if tail.strip():
        try:
            records.append(_parse(path, len(complete) + 1, tail))
            if repair:
                with path.open("ab") as f:
                    f.write(b"\n")
        except ValueError:
            if not repair:
                raise InputError(f"{path}:{len(complete) + 1}: the last line is incomplete (a run cut off while "
                                 "writing?); rerun the task to redo it, or delete the line") from None
            with path.open("r+b") as f:
                f.truncate(len(raw) - len(tail))
    return records


def _parse(path: Path, number: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise InputError(f"{path}:{number}: malformed result line ({exc}); fix or delete it") from None
    if not isinstance(record, dict):
        raise InputError(f"{path}:{number}: a result line must be a JSON object")
    return record


def rewrite_records(path: Path, records: list[dict]) -> None:
    """Replace the file's lines at once (used to drop records that are to be redone)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)


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


def input_lines(path: Path):
    """``(where, object)`` for each non-empty line of an input JSONL file (data, not results);
    ``where`` is ``file:line`` for error messages. A line that is not JSON is an error saying where."""
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})") from None


def read_table_rows(path: Path, where: str) -> list:
    """Rows of a parquet file, a JSON-lines file or a JSON file (a list of rows, or pandas' ``to_json()`` columns
    ``{column: {row: value}}``), as a hub dataset's files hold them; an unreadable file is one line naming
    ``where`` (the config field it came from). A JSON file of another shape is returned as it is."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except (OSError, ValueError, ImportError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{where}: {path} is not readable as {path.suffix[1:]} ({detail})") from None
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):  # pandas "columns"
        keys = list(next(iter(data.values())))
        return [{column: values[k] for column, values in data.items()} for k in keys]
    return data
