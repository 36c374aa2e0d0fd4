"""LongBench v2 prompts as the official ``pred.py`` builds them, truncated as its ``query_llm`` does.

Transcribed from THUDM/LongBench ``pred.py`` (top level, the v2 code):
- the templates ``prompts/0shot.txt``, ``0shot_cot.txt`` and ``0shot_cot_ans.txt`` (copied verbatim
  into ``eval/data/longbench_v2``), filled by one chain of ``str.replace`` in pred.py's order, each
  value ``.strip()``-ed, ``$COT$`` (the stripped first response) last;
- middle truncation: ``tokenizer.encode(prompt)`` (special tokens included), and when longer than
  ``max_len``, ``ids[:max_len//2] + ids[-max_len//2:]`` decoded at once with ``skip_special_tokens``;
- generation lengths: 128 new tokens for an answer, 1024 for the chain of thought.
The official script then sends the prompt as one user message to a chat API (the served model's
chat template); here the model config's ``chat_format`` wraps it (``eval.chat``).
"""
from __future__ import annotations

from pathlib import Path

from ..chat import encode_chat_split
from snapkv.errors import InputError

_DATA = Path(__file__).resolve().parent.parent / "data" / "longbench_v2"
ZERO_SHOT, COT, COT_ANSWER = "0shot", "0shot_cot", "0shot_cot_ans"
TEMPLATES = {name: (_DATA / f"{name}.txt").read_text(encoding="utf-8") for name in (ZERO_SHOT, COT, COT_ANSWER)}

ANSWER_TOKENS = 128    # pred.py: max_new_tokens=128 (the answer; also the second pass with cot)
COT_TOKENS = 1024      # pred.py: max_new_tokens=1024 (the chain of thought, cot's first pass)
OFFICIAL_MAX_LEN = 120000  # config/model2maxlen.json: every open model there
# what 0shot_cot_ans.txt has in place of the document
OMITTED = "The text is too long and omitted here."


def fill(template: str, row: dict, cot: str | None = None) -> str:
    """pred.py's substitution, verbatim (a value holding a later placeholder gets it replaced too)."""
    prompt = (template.replace('$DOC$', row['context'].strip()).replace('$Q$', row['question'].strip())
              .replace('$C_A$', row['choice_A'].strip()).replace('$C_B$', row['choice_B'].strip())
              .replace('$C_C$', row['choice_C'].strip()).replace('$C_D$', row['choice_D'].strip()))
    if cot is not None:
        prompt = prompt.replace('$COT$', cot)
    return prompt


def middle_truncate(tokenizer, prompt: str, max_len: int) -> str:
    """pred.py's ``query_llm`` truncation for a Hugging Face tokenizer (``model in model_map``).

    Unlike LongBench v1's pred.py, the kept ids are decoded in one call (v1 decodes each half and
    joins the texts) and ``-max_len//2`` rounds up: an odd ``max_len`` keeps ``max_len`` ids (v1:
    ``max_len - 1``)."""
    input_ids = tokenizer.encode(prompt)
    if len(input_ids) > max_len:
        input_ids = input_ids[:max_len//2] + input_ids[-max_len//2:]
        prompt = tokenizer.decode(input_ids, skip_special_tokens=True)
    return prompt


def question_at(template_name: str, prompt: str) -> int:
    """Where the question part of a (truncated) prompt starts: where the template's text after the
    document begins (``0shot_cot_ans.txt`` has no document: right after the sentence in its place)."""
    template = TEMPLATES[template_name]
    if "$DOC$" in template:
        marker = template[template.index("$DOC$") + len("$DOC$"):template.index("$Q$")]
        return prompt.rfind(marker)
    head = template[:template.index(OMITTED) + len(OMITTED)]
    return len(head) if prompt.startswith(head) else -1


def build(tokenizer, row: dict, template_name: str, max_len: int, chat_format: str,
          cot: str | None = None) -> tuple[list[int], int, bool]:
    """``(ids, question_tokens, truncated)`` of one prompt: filled, truncated, wrapped, tokenized;
    the last ``question_tokens`` ids are the template's text after the document, the question and
    the choices (and the chat wrapper's tail)."""
    full = fill(TEMPLATES[template_name], row, cot)
    prompt = middle_truncate(tokenizer, full, max_len)
    at = question_at(template_name, prompt)
    if at < 0:
        raise InputError(f"longbench_v2.max_length={max_len}: the prompt of row {row['_id']!r} truncated to it "
                         "no longer holds the text after the document intact, so its question part cannot be "
                         "found; use a larger longbench_v2.max_length")
    ids, question_tokens = encode_chat_split(tokenizer, prompt, chat_format, at)
    return ids, question_tokens, prompt != full
