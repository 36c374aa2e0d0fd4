"""Samples for the hit-rate study: a prompt and a response to teacher-force.

- LongBench rows (``observe.data=longbench:<dataset>:<dir>``): the dataset's official prompt in the
  model's chat format; the response is the first reference answer, or the model's own greedy output
  (``observe.response=model``). ``observe.question_position=start`` moves the question before the
  document (the paper's §4.2 variant; the question is then outside the last window).
- Conversations (``observe.data=PATH.jsonl``, Ultrachat's form): each line ``{"id", "data": [user,
  assistant, user, ...]}`` or ``{"messages": [{"role", "content"}, ...]}``; the last assistant turn is
  the response, every turn before it the prompt (chat template). The paper filtered Ultrachat to
  prompts over 3K and responses over 512 tokens (``observe.min_prompt_tokens``,
  ``observe.min_response_tokens``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..chat import encode_chat
from ..jsonl import input_lines
from snapkv.errors import InputError

QUESTION_POSITIONS = ("end", "start")  # observe.question_position: where a LongBench question goes


@dataclass
class Sample:
    id: str
    prompt_ids: list[int]
    response: str | None
    row: dict | None = None


def _turns(record: dict, where: str) -> list[dict]:
    if isinstance(record.get("messages"), list):
        turns = record["messages"]
        if not all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in turns):
            raise InputError(f"{where}: each of 'messages' needs 'role' and 'content'")
        return turns
    if isinstance(record.get("data"), list) and all(isinstance(t, str) for t in record["data"]):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(record["data"])]
    raise InputError(f"{where}: a conversation needs 'data' (a list of turns) or 'messages'")


def conversation_samples(path: Path, tokenizer) -> list[Sample]:
    samples = []
    for where, record in input_lines(path):
        turns = _turns(record, where)
        if len(turns) < 2 or turns[-1]["role"] != "assistant":
            raise InputError(f"{where}: the conversation must end with an assistant turn (the response)")
        text = tokenizer.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        samples.append(Sample(str(record.get("id", where.rsplit(":", 1)[1])), ids, turns[-1]["content"]))
    return samples


def question_first(template: str, row: dict) -> str:
    """The dataset prompt with the question moved before the document (§4.2's "question at the start")."""
    return f"Question: {row['input']}\n\n" + template.format(**{**row, "input": "(the question above)"})


def longbench_samples(spec: str, tokenizer, chat_format: str, max_length: int, question_position: str) -> list[Sample]:
    from ..longbench.data import dataset_file, read_dataset
    from ..longbench.prompt import PROMPTS, build_input_ids, middle_truncate
    _, dataset, data_dir = (spec.split(":", 2) + ["", ""])[:3]
    if not dataset:
        raise InputError(f"observe.data={spec!r}: use longbench:<dataset>:<dir> or a conversations .jsonl")
    samples = []
    for row in read_dataset(dataset_file(dataset, data_dir or None)):
        if question_position == "end":
            ids = build_input_ids(tokenizer, row, dataset, max_length, chat_format)
        else:
            text = middle_truncate(tokenizer, question_first(PROMPTS[dataset], row), max_length)
            ids = encode_chat(tokenizer, text, chat_format)
        samples.append(Sample(row["_id"], ids, row["answers"][0] if row["answers"] else None, row))
    return samples


def load_samples(cfg, tokenizer) -> list[Sample]:
    observe = cfg.observe
    spec = str(observe.data)
    if spec.startswith("longbench:"):
        return longbench_samples(spec, tokenizer, cfg.model.chat_format, int(cfg.model.max_length),
                                 observe.question_position)
    if not Path(spec).is_file():
        raise InputError(f"observe.data={spec!r}: not longbench:<dataset>:<dir> and no such .jsonl file")
    if observe.question_position != "end":
        raise InputError("observe.question_position=start needs LongBench rows (observe.data=longbench:...)")
    return conversation_samples(Path(spec), tokenizer)
