"""The rows of AIME25 and MATH-500 as kvpress evaluates them: the hub's copies, or a local one.

kvpress's ``evaluate.py`` reads ``load_dataset(DATASET_REGISTRY[name], split="test")`` with
``"aime25": "alessiodevoto/aime25"`` and ``"math500": "alessiodevoto/math500"``
(``evaluation/evaluate_registry.py``). Every kvpress dataset has the columns ``context``, ``question``,
``answer_prefix``, ``answer`` and ``max_new_tokens`` (``evaluation/README.md``); for these two the context
is a single space, the question the problem, the answer prefix empty, and ``max_new_tokens`` 32000
(AIME25) or 4096 (MATH-500); MATH-500's rows also carry ``subject``, ``level`` and ``unique_id``
(Hendrycks' MATH, in the 500-problem test split of OpenAI's PRM800K). Other columns are kept and
copied to the records.

``math.data=PATH`` reads a local copy in the same schema: a parquet, JSON-lines or JSON (a list of
rows) file; a folder in the hub's layout (``data/test-*.parquet``, as ``hf download`` leaves it); or a
folder written by ``datasets``' ``save_to_disk``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from snapkv.errors import InputError

from ..jsonl import read_table_rows

DATASETS = ("aime25", "math500")
HUB = {"aime25": "alessiodevoto/aime25", "math500": "alessiodevoto/math500"}
SPLIT = "test"
COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")
FIELD = "math.data"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def data_source(dataset: str, path: str | None) -> str:
    """What the settings fingerprint records about where the rows come from (with their digest)."""
    return f"hub:{HUB[dataset]}" if path is None else str(Path(path).resolve())


def digest(rows: list[dict]) -> str:
    """sha256 of the rows in order (what a record depends on, whatever file held them)."""
    text = json.dumps(rows, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return type(exc).__name__ + (f": {text}" if text else "")


def hub_folder(dataset: str, revision: str) -> tuple[Path, str | None]:
    """The hub repository of ``dataset`` at ``revision``, downloaded once into the Hugging Face cache (a
    cached copy serves offline), and the commit it is at."""
    repo = HUB[dataset]
    try:
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(repo, repo_type="dataset", revision=revision))
    except Exception as exc:  # noqa: BLE001 - offline, refused, not installed: one line naming the field
        raise InputError(f"{FIELD}: no local copy given and {repo}@{revision} could not be read from the Hugging "
                         f"Face hub ({_first_line(exc)}); download it (hf download {repo} --repo-type dataset "
                         f"--local-dir DIR) and pass {FIELD}=DIR") from None
    return folder, folder.name if folder.parent.name == "snapshots" else None


def _data_files(folder: Path) -> list[Path]:
    """A folder's data files of the ``test`` split (named ``test*`` or in a ``test`` folder, as ``datasets``
    assigns splits), or all its data files when none is named so."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    tests = [p for p in found if p.name.startswith(SPLIT) or SPLIT in p.relative_to(folder).parts[:-1]]
    return tests or found


def _read_file(path: Path, where: str) -> list:
    data = read_table_rows(path, where)
    if not isinstance(data, list):
        raise InputError(f"{where}: {path} must hold a JSON list of rows with {', '.join(COLUMNS)}")
    return data


def _saved_dataset(folder: Path, where: str) -> list:
    """Rows of a ``save_to_disk`` folder: a Dataset, or the ``test`` split of a DatasetDict."""
    from datasets import load_from_disk
    try:
        saved = load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001 - a damaged folder: one line
        raise InputError(f"{where}: {folder} is not a readable save_to_disk folder ({_first_line(exc)})") from None
    if hasattr(saved, "keys"):  # a DatasetDict
        if SPLIT not in saved and len(saved) != 1:
            raise InputError(f"{where}: {folder} has the splits {', '.join(saved)} and no {SPLIT!r} split")
        saved = saved[SPLIT] if SPLIT in saved else next(iter(saved.values()))
    return saved.to_list()


def read_path(path: Path, where: str) -> list:
    """Raw rows of a local file or folder (see the module doc)."""
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise InputError(f"{where}: not a {', '.join(s[1:] for s in DATA_SUFFIXES)} file")
        return _read_file(path, where)
    if not path.is_dir():
        raise InputError(f"{where}: no such file or folder")
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return _saved_dataset(path, where)
    files = _data_files(path)
    if not files:
        raise InputError(f"{where}: the folder holds no data files ({', '.join(s[1:] for s in DATA_SUFFIXES)})")
    return [row for file in files for row in _read_file(file, where)]


def check_row(row, where: str) -> dict:
    """One row in kvpress's schema (strings, an answer, a positive ``max_new_tokens``)."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be an object with {', '.join(COLUMNS)}")
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise InputError(f"{where}: no {', '.join(repr(c) for c in missing)} (kvpress's columns: {', '.join(COLUMNS)})")
    for name in ("context", "question", "answer_prefix"):
        if not isinstance(row[name], str):
            raise InputError(f"{where}: {name!r} must be a string, got {type(row[name]).__name__}")
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise InputError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    tokens = row["max_new_tokens"]
    if isinstance(tokens, float) and tokens.is_integer():
        tokens = int(tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise InputError(f"{where}: 'max_new_tokens' must be a positive integer, got {tokens!r}")
    return {**row, "max_new_tokens": tokens}


def load(dataset: str, path: str | None, revision: str = "main") -> tuple[list[dict], dict]:
    """``(rows, info)``: the checked rows in order, and where they come from (``source``, ``revision``: the
    hub commit when read from the hub, ``sha256``: their digest, ``rows``)."""
    if dataset not in HUB:
        raise InputError(f"math.dataset={dataset!r} is not allowed; choose one of {', '.join(DATASETS)}")
    if path is None:
        folder, commit = hub_folder(dataset, revision)
        files = _data_files(folder)
        if not files:
            raise InputError(f"{FIELD}: {HUB[dataset]}@{revision} holds no data files; pass {FIELD}=PATH")
        where = f"hub:{HUB[dataset]}"
        raw = [row for file in files for row in _read_file(file, where)]
    else:
        commit, where = None, f"{FIELD}={path}"
        raw = read_path(Path(path), where)
    rows = [check_row(row, f"{where}: row {i + 1}") for i, row in enumerate(raw)]
    if not rows:
        raise InputError(f"{where}: no rows")
    info = {"dataset": dataset, "source": data_source(dataset, path), "revision": commit,
            "sha256": digest(rows), "rows": len(rows)}
    return rows, info
