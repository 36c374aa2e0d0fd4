"""RULER's scoring (``scripts/eval/evaluate.py`` and ``scripts/eval/synthetic/constants.py`` @ e40fae1).

A prediction is stripped, every character U+0000-U+001F becomes a newline, and it is stripped again;
a reference string counts when it occurs in the prediction, both lower-cased. ``string_match_all``
(niah, vt, cwe, fwe) averages the share of a row's references found; ``string_match_part`` (qa)
counts a row when any reference is found. Scores are percentages rounded to 2 decimals.
"""
from __future__ import annotations

import re

from snapkv.errors import InputError

from .templates import BASE_TASKS, TASK_CONFIGS, check_task

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    total = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    total = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def metric_name(task: str) -> str:
    return BASE_TASKS[TASK_CONFIGS[check_task(task)][0]]["metric"]


def score(task: str, predictions: list[str], references: list[list[str]]) -> float:
    """RULER's task score of raw predictions (postprocessed here) against each row's ``outputs``."""
    if len(predictions) != len(references):
        raise InputError(f"ruler.score: {len(predictions)} predictions for {len(references)} references")
    for i, ref in enumerate(references):
        if isinstance(ref, str) or not ref:
            raise InputError(f"ruler.score: references[{i}] must be a non-empty list of strings")
    preds = [postprocess(p) for p in predictions]
    if len(references) > 0 and references[0][0] is not None:
        return METRICS[metric_name(task)](preds, [list(r) for r in references])
    return 0.0   # evaluate.py: no rows (or no reference) scores 0.0


def nulls(predictions: list[str]) -> str:
    """evaluate.py's ``Nulls`` column: empty predictions after postprocessing, ``"k/n"``."""
    preds = [postprocess(p) for p in predictions]
    return f"{sum(len(p) == 0 for p in preds)}/{len(preds)}"
