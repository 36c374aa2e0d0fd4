"""Accuracy of LongBench v2 predictions like official ``result.py``; reads, never writes, predictions.

    python -m eval.longbench_v2.score RUN_DIR              # pred/*.jsonl of one of our runs
    python -m eval.longbench_v2.score RESULTS_DIR          # a folder of prediction files (result.py's results/)
    ... [--compensated]                                    # result.py's compensated=True: no answer counts 0.25

Writes ``scores.json`` (``{file name: {column: accuracy}}``), ``summary.json`` (row counts) and
``result.txt`` (result.py's table) into the folder and prints the table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..jsonl import read_records, write_json_atomic
from snapkv.errors import InputError

COLUMNS = ("Overall", "Easy", "Hard", "Short", "Medium", "Long")
NEEDED = ("judge", "pred", "difficulty", "length")
OUTPUTS = ("scores.json", "summary.json")  # what the scorer writes, never read as predictions


def accuracy(pred_data: list[dict], compensated: bool = False) -> dict:
    """result.py's loop for one file: percentages rounded to 0.1; a difficulty other than "easy"
    counts as hard, a length other than "short" or "medium" as long. An empty bucket is None (result.py
    divides by zero there)."""
    easy, hard, short, medium, long = 0, 0, 0, 0, 0
    easy_acc, hard_acc, short_acc, medium_acc, long_acc = 0, 0, 0, 0, 0
    for pred in pred_data:
        acc = int(pred['judge'])
        if compensated and pred["pred"] == None:  # noqa: E711 (as result.py writes it)
            acc = 0.25
        if pred["difficulty"] == "easy":
            easy += 1
            easy_acc += acc
        else:
            hard += 1
            hard_acc += acc

        if pred['length'] == "short":
            short += 1
            short_acc += acc
        elif pred['length'] == "medium":
            medium += 1
            medium_acc += acc
        else:
            long += 1
            long_acc += acc

    def percent(hits, count):
        return round(100 * hits / count, 1) if count else None

    values = (percent(easy_acc + hard_acc, len(pred_data)), percent(easy_acc, easy), percent(hard_acc, hard),
              percent(short_acc, short), percent(medium_acc, medium), percent(long_acc, long))
    return dict(zip(COLUMNS, values))


def read_predictions(path: Path) -> list[dict]:
    """A prediction file as result.py reads it: one JSON array (or object), else JSON lines."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        records = data if isinstance(data, list) else [data]
    except ValueError:
        records = read_records(path)
    for number, record in enumerate(records, start=1):
        missing = [f for f in NEEDED if not isinstance(record, dict) or f not in record]
        if missing:
            raise InputError(f"{path}: record {number} has no field {missing[0]!r}")
    return records


def score_folder(folder: Path, compensated: bool = False) -> tuple[dict, dict]:
    """``(scores, summary)`` of every ``*.json``/``*.jsonl`` in ``folder``, named as result.py names
    them (the file name without its last suffix). Records that ran out of memory (``oom``) are
    counted, not scored (the official script writes no line for a failed call)."""
    scores, summary = {}, {}
    for path in sorted(p for p in Path(folder).iterdir()
                       if p.suffix in (".json", ".jsonl") and p.is_file() and p.name not in OUTPUTS):
        name = '.'.join(path.name.split('.')[:-1])
        records = read_predictions(path)
        scored = [r for r in records if not r.get("oom")]
        scores[name] = accuracy(scored, compensated)
        summary[name] = {"rows": len(records), "scored": len(scored), "oom": len(records) - len(scored),
                         "no_answer": sum(r["pred"] is None for r in scored)}
    return scores, summary


def table(scores: dict) -> str:
    """result.py's ``result.txt``: a header and one tab-separated line per file."""
    output = ["Model\t" + "\t".join(COLUMNS)]
    output += [name + "\t" + "\t".join(str(row[c]) for c in COLUMNS) for name, row in scores.items()]
    return "\n".join(output)


def write_scores(run_dir: Path, folder: Path | None = None, compensated: bool = False) -> dict:
    """Score ``folder`` (default: ``run_dir/pred``) and write scores.json, summary.json, result.txt
    into ``run_dir``."""
    run_dir = Path(run_dir)
    scores, summary = score_folder(folder or run_dir / "pred", compensated)
    info = run_dir / "dataset.json"
    if info.exists():
        rows = json.loads(info.read_text(encoding="utf-8"))["rows"]
        for counts in summary.values():
            counts["dataset_rows"] = rows
    write_json_atomic(run_dir / "scores.json", scores)
    write_json_atomic(run_dir / "summary.json", summary)
    (run_dir / "result.txt").write_text(table(scores), encoding="utf-8")
    return scores


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    compensated = "--compensated" in args
    args = [a for a in args if a != "--compensated"]
    if len(args) != 1:
        print("usage: python -m eval.longbench_v2.score RUN_DIR | RESULTS_DIR [--compensated]", file=sys.stderr)
        return 2
    target = Path(args[0])
    try:
        if not target.is_dir():
            raise InputError(f"{target}: not a folder")
        folder = target / "pred" if (target / "pred").is_dir() else target
        scores = write_scores(target, folder, compensated)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(scores))
    print(f"wrote {target / 'scores.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
