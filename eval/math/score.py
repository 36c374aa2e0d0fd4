"""Scores of AIME25 and MATH-500 predictions: kvpress's own scorer, and math-verify beside it.

kvpress (``evaluation/benchmarks/aime25/calculate_metrics.py`` and ``.../math500/calculate_metrics.py``):
the answer is the text after a ``boxed{`` up to the first ``}`` after it, compared as a string with
``str(answer)``; ``answered`` counts predictions holding ``boxed{``; ``accuracy`` is correct over all rows
(0-1). The two files differ in one index, which is kept:

- AIME25 takes the last ``boxed{`` (``split("boxed{")[-1]``). Without one, the "answer" is the whole
  prediction up to its first ``}``, which never equals a three-digit answer in practice.
- MATH-500 takes the first (``split("boxed{")[1]``); without one there is no answer (None).

No brace is balanced: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1``, so a reference holding braces never
matches; nothing is normalised (``\\boxed{ 5 }`` is not ``5``). That is the score kvpress reports.

math-verify (Hugging Face's ``math-verify``, the optional extra ``math``) decides mathematical
equivalence instead: ``verify(parse("\\boxed{" + answer + "}"), parse(prediction))`` with its default
extraction (the last boxed answer first, then LaTeX and plain expressions). Without the package the
column is None and the scores say why.

    python -m eval.math.score RUN_DIR      # score a run's pred/<dataset>.jsonl again (e.g. once math-verify is there)
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from ..jsonl import read_records, write_json_atomic
from snapkv.errors import InputError

SCORES_FILE, TABLE_FILE = "scores.json", "result.txt"
MATH_VERIFY_MISSING = ("math-verify is not installed (pip install 'snapkv-bench[math]' or pip install math-verify; "
                       "make setup installs it): the math_verify column is None")


def extract_boxed_last(prediction: str) -> str:
    """AIME25's extraction: after the last ``boxed{`` (the whole text when there is none), up to a ``}``."""
    return str(prediction.split("boxed{")[-1].split("}")[0])


def extract_boxed_first(prediction: str) -> str | None:
    """MATH-500's extraction: after the first ``boxed{``, up to a ``}``; None without one."""
    parts = prediction.split("boxed{")
    return str(parts[1].split("}")[0]) if len(parts) > 1 else None


EXTRACT = {"aime25": extract_boxed_last, "math500": extract_boxed_first}


def kvpress_answer(dataset: str, prediction: str) -> str | None:
    return EXTRACT[dataset](prediction)


def kvpress_correct(dataset: str, prediction: str, answer) -> bool:
    """kvpress's verdict: the extracted text equals ``str(answer)``."""
    return kvpress_answer(dataset, prediction) == str(answer)


def answered(prediction: str) -> bool:
    return "boxed{" in prediction


def kvpress_metrics(dataset: str, records: list[dict]) -> dict:
    """kvpress's ``calculate_metrics`` over records with ``predicted_answer`` and ``answer``:
    ``{"correct", "answered", "accuracy", "total"}`` (accuracy None for no record, where kvpress divides
    by zero)."""
    correct = sum(kvpress_correct(dataset, r["predicted_answer"], r["answer"]) for r in records)
    done = sum(answered(r["predicted_answer"]) for r in records)
    return {"correct": correct, "answered": done, "accuracy": correct / len(records) if records else None,
            "total": len(records)}


def math_verify_functions():
    """``(parse, verify)`` of math-verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def math_verify_correct(prediction: str, answer, functions=None) -> bool | None:
    """math-verify's verdict on ``prediction`` against the reference ``answer``; None without the package.
    Its timeouts use SIGALRM, so they are on in the main thread only; an error in it counts as wrong."""
    functions = functions or math_verify_functions()
    if functions is None:
        return None
    parse, verify = functions
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse("\\boxed{" + str(answer) + "}", parsing_timeout=timeout)
        return bool(verify(gold, parse(prediction, parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - math-verify raises on odd input (and times out): not equivalent
        return False


def math_verify_metrics(records: list[dict]) -> dict | None:
    """``{"correct", "accuracy", "total"}`` by math-verify, or None without the package."""
    functions = math_verify_functions()
    if functions is None:
        return None
    correct = sum(bool(math_verify_correct(r["predicted_answer"], r["answer"], functions)) for r in records)
    return {"correct": correct, "accuracy": correct / len(records) if records else None, "total": len(records)}


def pred_path(run_dir: Path, dataset: str) -> Path:
    return Path(run_dir) / "pred" / f"{dataset}.jsonl"


def score_records(dataset: str, records: list[dict], dataset_rows: int | None = None) -> dict:
    """A run's scores: kvpress's metrics and math-verify's over the records that did not run out of
    memory (those are counted, not scored), answers cut at ``max_new_tokens``, and notes."""
    scored = [r for r in records if not r.get("oom")]
    verified = math_verify_metrics(scored)
    scores = {"dataset": dataset, "items": len(records), "scored": len(scored), "oom": len(records) - len(scored),
              "hit_max_new_tokens": sum(bool(r.get("hit_max_new_tokens")) for r in scored),
              "kvpress": kvpress_metrics(dataset, scored), "math_verify": verified, "notes": []}
    if dataset_rows is not None:
        scores["dataset_rows"] = dataset_rows
    if verified is None:
        scores["notes"].append(MATH_VERIFY_MISSING)
    return scores


def write_scores(run_dir: Path, dataset: str, dataset_rows: int | None = None) -> dict:
    """Score ``pred/<dataset>.jsonl`` of a run: ``scores.json`` and ``result.txt`` (the table)."""
    old = Path(run_dir) / SCORES_FILE
    if dataset_rows is None and old.exists():  # rescoring a run: keep what it knew of the data
        dataset_rows = json.loads(old.read_text(encoding="utf-8")).get("dataset_rows")
    scores = score_records(dataset, read_records(pred_path(run_dir, dataset)), dataset_rows)
    write_json_atomic(Path(run_dir) / SCORES_FILE, scores)
    (Path(run_dir) / TABLE_FILE).write_text(table([scores]) + "\n", encoding="utf-8")
    return scores


def percent(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


HEADER = ("dataset", "items", "kvpress accuracy %", "answered", "math-verify accuracy %", "cut at max_new_tokens",
          "oom")


def row_cells(scores: dict) -> list[str]:
    verified = scores.get("math_verify")
    return [scores["dataset"], str(scores["scored"]), percent(scores["kvpress"]["accuracy"]),
            str(scores["kvpress"]["answered"]), percent(None if verified is None else verified["accuracy"]),
            str(scores["hit_max_new_tokens"]), str(scores["oom"])]


def table(all_scores: list[dict]) -> str:
    """A Markdown table, one line per run's scores, and the notes under it."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
    lines += ["| " + " | ".join(row_cells(s)) + " |" for s in all_scores]
    notes = sorted({note for s in all_scores for note in s.get("notes", [])})
    return "\n".join(lines + [f"\n{note}" for note in notes])


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m eval.math.score RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    try:
        found = sorted((run_dir / "pred").glob("*.jsonl")) if run_dir.is_dir() else []
        names = [p.stem for p in found if p.stem in EXTRACT]
        if not names:
            raise InputError(f"{run_dir}: no pred/aime25.jsonl or pred/math500.jsonl (a run folder of eval.math)")
        all_scores = [write_scores(run_dir, name) for name in names]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(all_scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
