"""Grid tasks (needle, lines) on the task engine: one line a (length, depth) cell, resumable;
out-of-memory lengths; cells a dead process left.

The results file holds one line a cell. Before a cell runs, ``running.json`` names it (every cell in
flight, with ``batch.items``); a cell leaves it once its line is written. A later run that finds cells
there knows the previous process died inside them (killed by the system: host out of memory, a time
limit, a signal), which is recorded as a failure, never as an OOM.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .engine import PredictionTask, Prompt, SettingRun
from .jsonl import append_record, read_records, rewrite_records, write_json_atomic

RUNNING = "running.json"
KILLED = "the process died while running this cell (killed by the system: host memory, a time limit or a signal)"


def key(cell: dict) -> tuple:
    return cell["context_length"], float(cell["depth_percent"])


def load_cells(results: Path, retry_oom: bool, retry_failed: bool) -> list[dict]:
    """Cells so far; a cell a dead process left becomes a failure line; retried cells are dropped."""
    cells = read_records(results, repair=True)
    running = results.parent / RUNNING
    for cell in in_flight(results):
        if key(cell) not in {key(c) for c in cells}:
            failure = {**cell, "response": None, "score": None, "oom": False, "failed": KILLED}
            append_record(results, failure)
            cells.append(failure)
            print(f"a previous run died in cell {key(cell)}: recorded as failed (retry_failed=true runs it again)")
    running.unlink(missing_ok=True)
    keep = [c for c in cells if not (retry_oom and c.get("oom")) and not (retry_failed and c.get("failed"))]
    if len(keep) != len(cells):
        rewrite_records(results, keep)
    return keep


def in_flight(results: Path) -> list[dict]:
    """The cells ``running.json`` names (one cell, as written before batches, or a list)."""
    running = results.parent / RUNNING
    if not running.exists():
        return []
    named = json.loads(running.read_text(encoding="utf-8"))
    return [c for c in (named if isinstance(named, list) else [named]) if c]


def start_cell(results: Path, cell: dict) -> None:
    write_json_atomic(results.parent / RUNNING, [c for c in in_flight(results) if key(c) != key(cell)] + [cell])


def finish_cell(results: Path, cell: dict) -> None:
    append_record(results, cell)
    left = [c for c in in_flight(results) if key(c) != key(cell)]
    if left:
        write_json_atomic(results.parent / RUNNING, left)
    else:
        (results.parent / RUNNING).unlink(missing_ok=True)


def out_of_memory_everywhere(cells: list[dict], length: int, depths: list[float]) -> bool:
    ooms = {float(c["depth_percent"]) for c in cells if c["context_length"] == length and c.get("oom")}
    return bool(depths) and all(d in ooms for d in depths)


@dataclass
class Cell:
    length: int
    depth: float

    @property
    def key(self) -> tuple:
        return self.length, float(self.depth)


class GridTask(PredictionTask):
    """A (length, depth) grid task on the engine: one line a cell in ``results_file``, resumable;
    after a length ran out of memory at every depth, longer ones are recorded as OOM unrun
    (``skip_after_oom``); an OOM is recorded, never raised; any other error stops the run."""

    results_file = ""
    section = ""   # the task's config section (needle, lines)

    def grid(self, cfg) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def build(self, cell: Cell) -> tuple[list[int], dict, int]:
        """The cell's prompt ids, the fields recorded with it, and how many of the last ids are the
        question part (``Prompt.question_tokens``; 0 where the task does not split its prompts)."""
        raise NotImplementedError

    def score(self, response: str, fields: dict) -> dict:
        raise NotImplementedError

    def generation(self, model, tokenizer) -> tuple[int, list[int]]:
        """Tokens to generate and the stop ids."""
        raise NotImplementedError

    def items(self, cfg) -> list[Cell]:
        self.lengths, self.depths = self.grid(cfg)
        self.options = cfg[self.section]
        return [Cell(n, d) for n in self.lengths for d in self.depths]

    def open(self, run: SettingRun, items) -> set:
        results = run.out / self.results_file
        opts = self.options
        run.state["cells"] = load_cells(results, bool(opts.get("retry_oom")), bool(opts.get("retry_failed")))
        done = {key(c) for c in run.state["cells"]}
        return {item.key for item in items} - done

    def skip(self, run: SettingRun, item: Cell) -> bool:
        cells = run.state["cells"]
        shorter_oom = [n for n in sorted({c["context_length"] for c in cells})
                       if n < item.length and out_of_memory_everywhere(cells, n, self.depths)]
        if not (self.options.get("skip_after_oom", True) and shorter_oom):
            return False
        cell = {"context_length": item.length, "depth_percent": item.depth, "response": None, "score": None,
                "oom": True, "skipped": f"{shorter_oom[0]} tokens ran out of memory at every depth (skip_after_oom)"}
        finish_cell(run.out / self.results_file, cell)
        cells.append(cell)
        return True

    def prompt(self, item: Cell, model, tokenizer) -> Prompt:
        if not hasattr(self, "_generation"):
            self._generation = self.generation(model, tokenizer)
        built = time.perf_counter()
        ids, fields, question = self.build(item)
        max_new, stops = self._generation
        return Prompt(ids, max_new, stops, fields={**fields, "build_s": round(time.perf_counter() - built, 3)},
                      question_tokens=question)

    def _cell(self, item: Cell, prompt: Prompt) -> dict:
        fields = {k: v for k, v in prompt.fields.items() if k != "build_s"}
        return {"context_length": item.length, "depth_percent": item.depth, "input_tokens": len(prompt.ids),
                **fields, "build_s": prompt.fields["build_s"]}

    def started(self, run: SettingRun, item: Cell, prompt: Prompt) -> None:
        start_cell(run.out / self.results_file, self._cell(item, prompt))

    def record(self, run: SettingRun, item: Cell, prompt: Prompt, generation, text) -> None:
        cell = self._cell(item, prompt)
        if generation is None:
            cell.update(response=None, score=None, oom=True)
        else:
            response = text.strip()
            cell.update(response=response, **self.score(response, prompt.fields), oom=False,
                        prefill_s=round(generation.prefill_s, 4),
                        cache_tokens=max(generation.cache_lengths) if generation.cache_lengths else None,
                        cost=generation.cost())
        finish_cell(run.out / self.results_file, cell)
        run.state["cells"].append(cell)
