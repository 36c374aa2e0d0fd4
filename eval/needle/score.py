"""Needle scores, all in [0, 1]: recall of the answer's words, exact containment, and the needle
harness's ROUGE-1.

``rouge1`` is the scorer of the harness the SnapKV needle figure descends from (gkamradt's NIAH as
adapted by Long-Context-Data-Engineering and KVCache-Factory ``run_needle_in_haystack.py``): the
ROUGE-1 F-measure (``rouge_score``, Porter stemmer) of the response against the needle sentence,
which that code multiplies by 10; here it stays on 0-1. An empty response scores 0, as there.
"""
from __future__ import annotations

from snapkv.errors import InputError, check_choice

from collections import Counter
from functools import lru_cache

from ..longbench.metrics import normalize_answer

SCORERS = ("recall", "exact", "rouge1")


def recall_score(response: str, answer: str) -> float:
    """Share of the answer's words (LongBench-normalized) found in the response, in [0, 1]."""
    truth = Counter(normalize_answer(answer).split())
    if not truth:
        raise InputError("needle.answer normalizes to no words; give an answer with words")
    found = Counter(normalize_answer(response).split())
    return sum((truth & found).values()) / sum(truth.values())


def exact_score(response: str, answer: str) -> float:
    return float(normalize_answer(answer) in normalize_answer(response))


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1_score(response: str, needle: str) -> float:
    if not response:
        return 0.0
    return float(_rouge().score(needle, response)["rouge1"].fmeasure)


def cell_scores(response: str, needles) -> dict:
    """Every scorer's value for one response, averaged over the needles (multi-needle cells)."""
    n = len(needles)
    return {"recall": sum(recall_score(response, x.answer) for x in needles) / n,
            "exact": sum(exact_score(response, x.answer) for x in needles) / n,
            "rouge1": sum(rouge1_score(response, x.text) for x in needles) / n}


def check_scorer(name: str) -> str:
    check_choice("needle.scorer", name, SCORERS)
    return name
