"""Grid tasks (needle, lines): one line a (length, depth) cell, resumable; out-of-memory lengths;
cells a dead process left; the loop that runs the cells.

The results file holds one line a cell. Before a cell runs, ``running.json`` names it; it is removed
once the cell's line is written. A later run that finds it knows the previous process died inside
that cell (killed by the system: host out of memory, a time limit, a signal), which is recorded as
a failure, never as an OOM.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .jsonl import append_record, read_records, rewrite_records, write_json_atomic
from .runner import is_oom

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
            print(f"a previous run died in cell {key(cell)}: recorded as failed (retry_failed=true runs it again)")
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


@dataclass
class Prompt:
    """One cell's prompt and what scoring it needs."""
    ids: list[int]
    fields: dict          # recorded in the cell (positions, expected value, ...)


def run_grid(runner, tokenizer, compressor, todo, depths, cells: list[dict], results: Path, *, build, score,
             max_new_tokens: int, stops: list[int], skip_after_oom: bool, desc: str) -> None:
    """Run the cells ``todo`` (``(length, depth)`` pairs) in order, one line each in ``results``.

    ``build(length, depth) -> Prompt``, ``score(response, prompt) -> dict`` (with ``score``). After
    a length ran out of memory at every depth, longer lengths are recorded as OOM unrun
    (``skip_after_oom``); an OOM is recorded, never raised; any other error stops the run.
    """
    bar = tqdm(todo, desc=desc, unit="cell", dynamic_ncols=True)
    for length, depth in bar:
        bar.set_postfix(length=length, depth=depth)
        cell = {"context_length": length, "depth_percent": depth}
        shorter_oom = [n for n in sorted({c["context_length"] for c in cells})
                       if n < length and out_of_memory_everywhere(cells, n, depths)]
        if skip_after_oom and shorter_oom:
            cell.update(response=None, score=None, oom=True,
                        skipped=f"{shorter_oom[0]} tokens ran out of memory at every depth (skip_after_oom)")
            finish_cell(results, cell)
            cells.append(cell)
            continue
        built = time.perf_counter()
        prompt = build(length, depth)
        cell.update(input_tokens=len(prompt.ids), **prompt.fields, build_s=round(time.perf_counter() - built, 3))
        start_cell(results, cell)
        try:
            gen = runner.generate(torch.tensor([prompt.ids]), compressor, max_new_tokens, stop_ids=stops)
            tokens = gen.tokens[:-1] if gen.tokens and gen.tokens[-1] in stops else gen.tokens
            response = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            cell.update(response=response, **score(response, prompt), oom=False, prefill_s=round(gen.prefill_s, 4),
                        cache_tokens=max(gen.cache_lengths) if gen.cache_lengths else None)
        except Exception as exc:
            if not is_oom(exc):
                raise
            cell.update(response=None, score=None, oom=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        finish_cell(results, cell)
        cells.append(cell)
