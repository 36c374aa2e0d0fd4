"""LongBench v1 scoring, reproducing the official ``metrics.py`` / ``eval.py`` (THUDM/LongBench).

Quirks of the official code are reproduced on purpose, because published numbers (SnapKV's Table 1
among them) were computed with them. Each is marked ``QUIRK`` below and listed in docs/longbench.md (Deviations).
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter

import jieba
import numpy as np
from rouge import Rouge
from snapkv.errors import InputError

jieba.setLogLevel(60)

_CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501  (metrics.py's string)
_EN_PUNCTUATION = set(string.punctuation)
_ALL_PUNCTUATION = set(string.punctuation + _CN_PUNCTUATION)
# Datasets whose prediction is cut to its first line before scoring (few-shot tasks).
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop English articles, collapse whitespace (SQuAD style)."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def _f1(prediction_tokens: list, truth_tokens: list) -> float:
    overlap = sum((Counter(prediction_tokens) & Counter(truth_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(prediction_tokens), overlap / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, truth: str, **_) -> float:
    return _f1(normalize_answer(prediction).split(), normalize_answer(truth).split())


def qa_f1_zh(prediction: str, truth: str, **_) -> float:
    def tokens(text):
        return [t for t in (normalize_zh_answer(w) for w in jieba.cut(text, cut_all=False)) if t]
    return _f1(tokens(prediction), tokens(truth))


def rouge_l(prediction: str, truth: str, **_) -> float:
    try:
        return Rouge().get_scores([prediction], [truth], avg=True)["rouge-l"]["f"]
    except Exception:  # QUIRK: the official bare ``except`` scores any rouge failure (e.g. an empty prediction) as 0.0
        return 0.0


def rouge_l_zh(prediction: str, truth: str, **_) -> float:
    return rouge_l(" ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(truth, cut_all=False)))


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == str(target)) / len(numbers)


def count_score(prediction: str, truth: str, **_) -> float:
    return _share_of_numbers_equal(prediction, truth)


def retrieval_score(prediction: str, truth: str, **_) -> float:
    return _share_of_numbers_equal(prediction, re.findall(r"Paragraph (\d+)", truth)[0])


def retrieval_zh_score(prediction: str, truth: str, **_) -> float:
    return _share_of_numbers_equal(prediction, re.findall(r"段落(\d+)", truth)[0])


def difflib_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` as the official requirements install it: on difflib.

    QUIRK: with python-Levenshtein installed, fuzzywuzzy switches to a different matcher and code
    scores move; published numbers used difflib, so difflib is called directly here.
    """
    if a == b:  # fuzzywuzzy checks equality before emptiness: ratio("", "") is 100
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, truth: str, **_) -> float:
    # QUIRK: only the first line without a backtick, "#" or "//" is compared; a prediction made
    # solely of comment lines is compared as the empty string.
    first = next((line for line in prediction.lstrip("\n").split("\n")
                  if "`" not in line and "#" not in line and "//" not in line), "")
    return difflib_ratio(first, truth) / 100


def classification_score(prediction: str, truth: str, all_classes=None, **_) -> float:
    matches = [name for name in all_classes if name in prediction]
    # QUIRK: the official code removes class names that are substrings of the truth while
    # iterating over the same list, so the element right after each removed one is skipped.
    i = 0
    while i < len(matches):
        name = matches[i]
        if name in truth and name != truth:
            matches.remove(name)
        i += 1
    return 1.0 / len(matches) if truth in matches else 0.0


DATASET_METRIC = {
    "narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1, "2wikimqa": qa_f1, "musique": qa_f1, "dureader": rouge_l_zh,
    "gov_report": rouge_l, "qmsum": rouge_l, "multi_news": rouge_l, "vcsum": rouge_l_zh,
    "trec": classification_score, "triviaqa": qa_f1, "samsum": rouge_l, "lsht": classification_score,
    "passage_retrieval_en": retrieval_score, "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score, "lcc": code_sim_score, "repobench-p": code_sim_score,
}


def base_dataset(dataset: str) -> str:
    """``qasper_e`` (LongBench-E) is scored with ``qasper``'s metric."""
    name = dataset[:-2] if dataset.endswith("_e") else dataset
    if name not in DATASET_METRIC:
        raise InputError(f"dataset={dataset!r} is not a LongBench dataset; allowed: {', '.join(DATASET_METRIC)}")
    return name


def score_sample(dataset: str, prediction: str, answers, all_classes=None) -> float:
    """Per-sample score in [0, 1], as official ``eval.py`` computes it."""
    name = base_dataset(dataset)
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET_METRIC[name]
    best = 0.0
    for truth in answers:
        best = max(best, metric(prediction, truth, all_classes=all_classes))
    return best


def _row_scores(dataset: str, rows) -> list[float]:
    return [score_sample(dataset, r["pred"], r["answers"], r.get("all_classes")) for r in rows]


def dataset_score(dataset: str, rows) -> float:
    """Official dataset score: ``round(100 * mean, 2)`` over the rows."""
    rows = list(rows)
    if not rows:
        raise InputError(f"dataset={dataset!r}: no rows to score")
    scores = _row_scores(dataset, rows)
    return round(100 * sum(scores) / len(scores), 2)


def dataset_score_e(dataset: str, rows) -> dict:
    """LongBench-E length buckets by the ``length`` field: <4000, <8000, else. Empty bucket: None."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    rows = list(rows)
    for row, score in zip(rows, _row_scores(dataset, rows)):
        length = row["length"]
        key = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[key].append(score)
    return {k: (round(100 * float(np.mean(v)), 2) if v else None) for k, v in buckets.items()}
