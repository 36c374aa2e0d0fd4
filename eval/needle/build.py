"""Needle prompts: a haystack cut to length, needles at sentence boundaries, the question after."""
from __future__ import annotations

from snapkv.errors import check_choice

from dataclasses import dataclass

from ..chat import encode_chat, encode_chat_split

PROMPTS = {
    # written for this project: the question after the document, inside the observation window
    "plain": ("Below is a long document. One sentence in it matters for the question that follows.\n\n"
              "{context}\n\n"
              "Answer the question using the document only, in one short sentence.\n"
              "Question: {question}"),
    # the prompt of the needle harness the SnapKV figure descends from (KVCache-Factory
    # run_needle_in_haystack.py, after Long-Context-Data-Engineering), fed without a chat wrapper
    "kvcache_factory": ("<|im_start|> This is a very long story book: <book> {context} </book>.\n "
                        "Based on the content of the book, Question: {question}\nAnswer:"),
}


@dataclass(frozen=True)
class Needle:
    text: str
    answer: str


def sentence_end_ids(tokenizer, haystack: list[int]) -> set[int]:
    ends = set()
    for token in set(haystack):
        piece = tokenizer.decode([token])
        if piece.rstrip().endswith((".", "!", "?", "。")):
            ends.add(token)
    return ends


def boundary_before(tokens: list[int], point: int, ends: set[int]) -> int:
    """The largest position <= ``point`` right after a sentence end (0 if there is none)."""
    while point > 0 and tokens[point - 1] not in ends:
        point -= 1
    return point


def insert_needles(tokenizer, haystack: list[int], needles: list[Needle], depths: list[float],
                   ends: set[int]) -> tuple[str, list[int]]:
    """Context text with each needle at its depth percent (moved back to a sentence boundary)."""
    points = [boundary_before(haystack, int(len(haystack) * d / 100), ends) for d in depths]
    pieces, last = [], 0
    for point, needle in sorted(zip(points, needles), key=lambda p: p[0]):
        pieces.append(tokenizer.decode(haystack[last:point]))
        pieces.append(" " + needle.text.strip() + " ")
        last = point
    pieces.append(tokenizer.decode(haystack[last:]))
    return "".join(pieces).strip(), points


def check_prompt(name: str) -> str:
    check_choice("needle.prompt", name, PROMPTS)
    return name


def prompt_ids(tokenizer, context: str, question: str, chat_format: str, prompt: str = "plain") -> list[int]:
    return encode_chat(tokenizer, PROMPTS[check_prompt(prompt)].format(context=context, question=question),
                       chat_format)


def prompt_split_ids(tokenizer, context: str, question: str, chat_format: str,
                     prompt: str = "plain") -> tuple[list[int], int]:
    """``prompt_ids``' ids and how many of the last ones are the question part: the template's text
    after ``{context}`` (the retrieval question and what frames it), and the chat wrapper's end."""
    template = PROMPTS[check_prompt(prompt)]
    head = template[:template.index("{context}")].format(context=context, question=question)
    return encode_chat_split(tokenizer, template.format(context=context, question=question), chat_format,
                             len(head) + len(context))


def overhead_tokens(tokenizer, needles: list[Needle], question: str, chat_format: str, prompt: str = "plain") -> int:
    """Prompt tokens that are not haystack: the template, the question and the needles."""
    frame = len(prompt_ids(tokenizer, "", question, chat_format, prompt))
    return frame + sum(len(tokenizer(" " + n.text.strip() + " ", add_special_tokens=False).input_ids)
                       for n in needles)


def needle_depths(depth: float, count: int) -> list[float]:
    """The first needle at ``depth``; further ones spread evenly over the rest of the context."""
    step = (100 - depth) / count
    return [depth + i * step for i in range(count)]
