"""Haystacks: neutral noise written here, any folder of .txt files, or LongBench contexts."""
from __future__ import annotations

from snapkv.errors import InputError

from pathlib import Path

NOISE_SENTENCES = (
    "The river keeps moving past the old stone bridge.",
    "A few clouds drift slowly over the quiet hills.",
    "Somewhere a kettle is starting to boil.",
    "The library opens its doors at nine every morning.",
    "Rows of bicycles wait outside the train station.",
    "Leaves gather in the corner of the empty courtyard.",
    "The baker sets out fresh loaves before sunrise.",
    "Trains come and go on schedule throughout the day.",
)


def noise_text(min_chars: int) -> str:
    parts, size, i = [], 0, 0
    while size < min_chars:
        sentence = NOISE_SENTENCES[i % len(NOISE_SENTENCES)]
        parts.append(sentence)
        size += len(sentence) + 1
        i += 1
    return " ".join(parts)


def folder_text(folder: Path) -> str:
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise InputError(f"needle.haystack={folder}: no .txt files there (use 'noise' or a folder of .txt files)")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def longbench_text(spec: str) -> str:
    """``longbench:<dataset>:<data_dir>``: the dataset's contexts, concatenated in file order."""
    from ..longbench.data import dataset_file, read_dataset
    _, dataset, data_dir = (spec.split(":", 2) + ["", ""])[:3]
    rows = read_dataset(dataset_file(dataset, data_dir or None))
    return "\n\n".join(r["context"] for r in rows)


def haystack_tokens(tokenizer, source: str, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` tokens of haystack (the text repeated as needed), no special tokens."""
    if source == "noise":
        text = noise_text(n_tokens * 8)
    elif source.startswith("longbench:"):
        text = longbench_text(source)
    else:
        if not Path(source).is_dir():
            raise InputError(f"needle.haystack={source!r}: not 'noise', 'longbench:<dataset>:<dir>' or a folder")
        text = folder_text(Path(source))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise InputError(f"needle.haystack={source!r} is empty")
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]
