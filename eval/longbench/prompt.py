"""LongBench prompts and generation rules, as the official prediction scripts apply them.

Two protocols share the prompt table, the middle truncation and the no-wrapper datasets; they
differ in when at least one new token is forced:
- ``longbench``: THUDM/LongBench ``LongBench/pred.py`` (``min_length=context+1`` on samsum only);
- ``snapkv``: FasterDecoding/SnapKV ``experiments/LongBench/pred_snap.py``, the script behind the
  SnapKV paper's Table 1 (``min_length=context+1`` on every dataset).
The prompt wrapper is the model config's ``chat_format`` (the paper models' configs set
pred_snap.py's wrapper), the dtype and tokenizer are model config fields too.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..chat import encode_chat, encode_chat_split
from .metrics import base_dataset
from snapkv.errors import InputError, check_choice

_DATA = Path(__file__).resolve().parent.parent / "data"
PROMPTS: dict[str, str] = json.loads((_DATA / "dataset2prompt.json").read_text(encoding="utf-8"))
MAX_NEW_TOKENS: dict[str, int] = json.loads((_DATA / "dataset2maxlen.json").read_text(encoding="utf-8"))
# Few-shot and code datasets are fed raw: pred.py applies no chat template to them.
NO_CHAT_DATASETS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")


def middle_truncate(tokenizer, prompt: str, max_length: int) -> str:
    """Keep the first and last ``max_length // 2`` tokens, decoded and re-joined as text (pred.py)."""
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True))


def build_input_ids(tokenizer, row: dict, dataset: str, max_length: int, chat_format: str) -> list[int]:
    name = base_dataset(dataset)
    prompt = PROMPTS[name].format(**row)
    # QUIRK (pred.py): truncation is measured before the chat wrapper, which then adds its tokens.
    prompt = middle_truncate(tokenizer, prompt, max_length)
    if name in NO_CHAT_DATASETS:
        return tokenizer(prompt, truncation=False).input_ids
    return encode_chat(tokenizer, prompt, chat_format)


def question_part(dataset: str, row: dict) -> str:
    """The prompt's text after the context: every template puts ``{context}`` before the question
    (text before the context, an instruction, stays with it)."""
    template = PROMPTS[base_dataset(dataset)]
    return template[template.index("{context}") + len("{context}"):].format(**row)


def build_split_ids(tokenizer, row: dict, dataset: str, max_length: int, chat_format: str) -> tuple[list[int], int]:
    """``(ids, question_tokens)``: ``build_input_ids``' ids and how many of the last ones are the
    question part (``query_aware=false`` appends them after the compressed context)."""
    name = base_dataset(dataset)
    prompt = middle_truncate(tokenizer, PROMPTS[name].format(**row), max_length)
    question = question_part(dataset, row)
    if not prompt.endswith(question):
        raise InputError(f"longbench {dataset} row {row.get('_id')}: the truncated prompt does not end with its "
                         "question part, so it cannot be split; use query_aware=true")
    return encode_chat_split(tokenizer, prompt, "none" if name in NO_CHAT_DATASETS else chat_format,
                             len(prompt) - len(question))


PROTOCOLS = {"longbench": "THUDM/LongBench LongBench/pred.py",
             "snapkv": "FasterDecoding/SnapKV experiments/LongBench/pred_snap.py"}


def check_protocol(protocol: str) -> str:
    check_choice("model.protocol", protocol, PROTOCOLS)
    return protocol


def min_new_tokens(dataset: str, protocol: str) -> int:
    """Tokens generated before EOS (and samsum's newline) may end the answer."""
    if check_protocol(protocol) == "snapkv" or base_dataset(dataset) == "samsum":
        return 1
    return 0


def generation_length(dataset: str, override: int | None) -> int:
    return int(override) if override else MAX_NEW_TOKENS[base_dataset(dataset)]


def extra_stop_ids(tokenizer, dataset: str) -> list[int]:
    """samsum also stops at a newline (pred.py passes the newline token as an extra EOS)."""
    if base_dataset(dataset) == "samsum":
        return [tokenizer.encode("\n", add_special_tokens=False)[-1]]
    return []
