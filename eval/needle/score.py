"""Deterministic needle scores: recall of the answer's words, and exact containment."""
from __future__ import annotations

from collections import Counter

from ..longbench.metrics import normalize_answer


def recall_score(response: str, answer: str) -> float:
    """Share of the answer's words (LongBench-normalized) found in the response, in [0, 1]."""
    truth = Counter(normalize_answer(answer).split())
    if not truth:
        raise ValueError("needle.answer normalizes to no words; give an answer with words")
    found = Counter(normalize_answer(response).split())
    return sum((truth & found).values()) / sum(truth.values())


def exact_score(response: str, answer: str) -> float:
    return float(normalize_answer(answer) in normalize_answer(response))
