"""``ruler.source=kvpress``: the RULER set kvpress's leaderboard evaluates, instead of generating one.

NVIDIA/kvpress ``evaluation/`` loads ``load_dataset("simonjegou/ruler", data_dir="4096", split="test")``
(``evaluate_config.yaml``: ``dataset: ruler``, ``data_dir: "4096"``). That set was made once by RULER's
``prepare.py`` (``evaluation/benchmarks/ruler/generate.sh``: the ``meta-llama/Meta-Llama-3.1-8B``
tokenizer, the ``base`` template, 500 samples a task, lengths 4096 / 8192 / 16384), then split by
``create_huggingface_dataset.py``: one row a sample with the columns ``context`` (the input up to the
last match of the task's question pattern), ``question`` (from there to its answer pattern),
``answer_prefix`` (the rest), ``answer`` (RULER's ``outputs``), ``task`` and ``max_new_tokens``; the
rows of each task in RULER's index order; no index, no length.

Here each row becomes a row of ``eval.ruler.generate`` (``input`` = context + question + answer
prefix, ``query_at`` = where the question starts, ``answer_prefix``, ``outputs``, ``index`` = its place
among its task's rows, ``length`` None), so the rest of the task (the tasks filter, ``samples``, the
query split, RULER's scoring) is the same. ``encode`` builds the prompt as kvpress's pipeline does.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from snapkv.errors import InputError

from ..chat import encode_kvpress
from ..jsonl import read_table_rows

HUB_REPO = "simonjegou/ruler"
SPLIT = "test"
COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")
FIELD = "ruler.kvpress_data"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
SOURCE = ("NVIDIA/kvpress evaluation/ (hub dataset simonjegou/ruler, made by RULER's prepare.py with the "
          "Llama-3.1 tokenizer, evaluation/benchmarks/ruler/create_huggingface_dataset.py)")


def data_source(path, hub_revision: str | None = None) -> str:
    """What the settings fingerprint records about where the rows come from (the same for every length,
    so a run can be extended to another length)."""
    if path is None:
        return f"hub:{HUB_REPO}" + (f"@{hub_revision}" if hub_revision else "")
    return str(Path(path).resolve())


def _hub_folder(length: int) -> tuple[Path, str | None]:
    """The hub files of one length (``<length>/*.parquet``), downloaded once into the Hugging Face
    cache (a cached copy serves offline), and the commit they come from."""
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(HUB_REPO, repo_type="dataset", allow_patterns=[f"{length}/*"])
    except Exception as exc:  # noqa: BLE001 - offline, refused, not installed: one line naming the field
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise InputError(f"{FIELD}: no local copy given and {HUB_REPO} ({length}) could not be read from the "
                         f"Hugging Face hub ({type(exc).__name__}{': ' + first if first else ''}); download its "
                         f"files (hf download {HUB_REPO} --repo-type dataset --local-dir DIR) and pass "
                         f"{FIELD}=DIR") from None
    folder = Path(folder)
    revision = folder.name if folder.parent.name == "snapshots" else None
    return folder / str(length), revision


def _data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES
                  and not p.name.startswith("."))


def _read(path: Path) -> list[dict]:
    """Rows of a parquet file, a JSON-lines file, or a JSON file (a list of rows, or pandas'
    ``to_json()`` columns ``{column: {row: value}}``)."""
    data = read_table_rows(path, FIELD)
    if isinstance(data, list):
        return data
    raise InputError(f"{FIELD}={path}: a JSON list of rows (or pandas' to_json columns) with {', '.join(COLUMNS)}")


def _files(path, length: int, lengths: int) -> list[Path]:
    where = Path(path)
    if where.is_file():
        if where.suffix not in DATA_SUFFIXES:
            raise InputError(f"{FIELD}={path}: not a {', '.join(s[1:] for s in DATA_SUFFIXES)} file")
        found, one_length = [where], True
    elif where.is_dir():
        sub = where / str(length)
        found, one_length = (_data_files(sub), False) if sub.is_dir() else (_data_files(where), True)
    else:
        raise InputError(f"{FIELD}={path}: no such file or folder")
    if one_length and lengths > 1:
        raise InputError(f"{FIELD}={path}: holds one length's rows, and ruler.lengths has {lengths}; give a folder "
                         "with one subfolder per length (the hub's layout: <length>/test-*.parquet)")
    if not found:
        raise InputError(f"ruler.lengths: {path} has no {length}/ folder of data files (the hub's layout: "
                         f"<length>/test-*.parquet), and no data files itself")
    return found


def _check_row(row, where: str) -> None:
    missing = [c for c in COLUMNS if c not in row] if isinstance(row, dict) else list(COLUMNS)
    if missing:
        raise InputError(f"{FIELD}={where}: not kvpress's RULER schema: no {', '.join(missing)} "
                         f"(columns: {', '.join(COLUMNS)})")
    answer = row["answer"]
    if isinstance(answer, str) or not answer or not all(isinstance(a, str) for a in answer):
        raise InputError(f"{FIELD}={where}: 'answer' must be a non-empty list of strings (RULER's outputs)")


@functools.lru_cache(maxsize=8)
def _load(path: str | None, length: int, lengths: int) -> tuple[dict, str]:
    if path is None:
        folder, revision = _hub_folder(length)
        if not folder.is_dir() or not _data_files(folder):
            raise InputError(f"ruler.lengths: {HUB_REPO} has no {length}/ data (kvpress's lengths: 4096, 8192, "
                             "16384)")
        files, source = _data_files(folder), data_source(None, revision)
    else:
        files, source = _files(path, length, lengths), data_source(path)
    by_task: dict[str, list[dict]] = {}
    for file in files:
        for i, row in enumerate(_read(file)):
            _check_row(row, f"{file}:{i}")
            by_task.setdefault(str(row["task"]), []).append(row)
    return {task: [to_ruler_row(r, i) for i, r in enumerate(rows)] for task, rows in by_task.items()}, source


def load(path: str | os.PathLike | None, length: int, lengths: int = 1) -> tuple[dict[str, list[dict]], str]:
    """``({task: rows}, source)``: one length's rows of kvpress's RULER set, as ``eval.ruler.generate``
    rows, and what the fingerprint records about where they come from. ``path`` None: the hub
    (``simonjegou/ruler``, folder ``<length>``); else a parquet / JSON-lines / JSON file, or a folder of
    them, or a folder with one such folder per length (the hub's layout). ``lengths``: how many lengths
    the run asks for (a file or a flat folder holds one)."""
    return _load(None if path is None else str(path), int(length), int(lengths))


def to_ruler_row(row: dict, index: int) -> dict:
    context, question, prefix = str(row["context"]), str(row["question"]), str(row["answer_prefix"])
    return {"index": index, "input": context + question + prefix, "outputs": [str(a) for a in row["answer"]],
            "length": None, "answer_prefix": prefix, "query_at": len(context),
            "max_new_tokens": int(row["max_new_tokens"])}


def encode(tokenizer, row: dict, chat_format: str) -> tuple[list[int], int] | None:
    """``(ids, question_tokens)`` of a row as kvpress's pipeline builds them (``eval.chat.encode_kvpress``), or
    None for a chat format kvpress has no counterpart of (the caller wraps it as for generated data)."""
    at, prefix = row["query_at"], row["answer_prefix"]
    text = row["input"]
    return encode_kvpress(tokenizer, text[:at], text[at:len(text) - len(prefix)], prefix, chat_format)
