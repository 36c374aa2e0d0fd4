"""A row's prompt as kvpress's ``KVPressTextGenerationPipeline.preprocess`` assembles it (kvpress 0.5.5).

The pipeline keeps the context (the part a press compresses) apart from the question:

- ``template`` (a tokenizer with a chat template): the user turn is the context followed by a long run of
  ``#``; the template is applied with ``add_generation_prompt=True`` and ``enable_thinking`` (False: the
  pipeline's default, which ``evaluate.py`` never changes) and split at that run. The text before it is the
  context; the question is ``question + the rest of the template + answer_prefix``.
- ``none`` (a tokenizer without one): BOS + context, then ``question + "\\n" + answer_prefix``.

Each part is tokenized on its own without special tokens. Here the question part's length is
``Prompt.question_tokens``: with ``query_aware=false`` the engine appends it after the context is
compressed, as kvpress's default (query-agnostic) run does; with ``query_aware=true`` (kvpress's
``query_aware=True`` moves the question into the context) the whole prompt is prefilled and compressed.
Other chat formats of the project have no counterpart in kvpress: the context and question are wrapped as
one user turn (``eval.chat``) and the answer prefix follows the wrapper.
"""
from __future__ import annotations

from ..chat import encode_chat_split, encode_kvpress


def encode(tokenizer, context: str, question: str, answer_prefix: str, chat_format: str,
           enable_thinking: bool = False) -> tuple[list[int], int]:
    """``(ids, question_tokens)`` of one row: the context's ids, then the question part's."""
    built = encode_kvpress(tokenizer, context, question, answer_prefix, chat_format, enable_thinking,
                           format_field="math.chat_format")
    if built is None:
        return encode_chat_split(tokenizer, context + question, chat_format, len(context), suffix=answer_prefix)
    return built
