"""The needle grid's result file: resume, out-of-memory lengths, and cells a dead process left.

``needle.jsonl`` holds one line a cell. Before a cell runs, ``running.json`` names it; it is removed
once the cell's line is written. A later run that finds it knows the previous process died inside
that cell (killed by the system: host out of memory, a time limit, a signal), which is recorded as
a failure, never as an OOM.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..jsonl import append_record, read_records, rewrite_records, write_json_atomic

RUNNING = "running.json"
KILLED = "the process died while running this cell (killed by the system: host memory, a time limit or a signal)"


def key(cell: dict) -> tuple:
    return cell["context_length"], float(cell["depth_percent"])


def load_cells(results: Path, retry_oom: bool, retry_failed: bool) -> list[dict]:
    """Cells so far; a cell a dead process left becomes a failure line; retried cells are dropped."""
    cells = read_records(results, repair=True)
    running = results.parent / RUNNING
    if running.exists():
        cell = json.loads(running.read_text(encoding="utf-8"))
        if cell and key(cell) not in {key(c) for c in cells}:
            failure = {**cell, "response": None, "score": None, "oom": False, "failed": KILLED}
            append_record(results, failure)
            cells.append(failure)
            print(f"needle: a previous run died in cell {key(cell)}: recorded as failed (needle.retry_failed=true "
                  "runs it again)")
        running.unlink()
    keep = [c for c in cells if not (retry_oom and c.get("oom")) and not (retry_failed and c.get("failed"))]
    if len(keep) != len(cells):
        rewrite_records(results, keep)
    return keep


def start_cell(results: Path, cell: dict) -> None:
    write_json_atomic(results.parent / RUNNING, cell)


def finish_cell(results: Path, cell: dict) -> None:
    append_record(results, cell)
    (results.parent / RUNNING).unlink(missing_ok=True)


def out_of_memory_everywhere(cells: list[dict], length: int, depths: list[float]) -> bool:
    ooms = {float(c["depth_percent"]) for c in cells if c["context_length"] == length and c.get("oom")}
    return bool(depths) and all(d in ooms for d in depths)
