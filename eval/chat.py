"""Chat formats: how a model config's ``chat_format`` wraps a prompt before tokenization."""
from __future__ import annotations

from snapkv.errors import InputError, check_choice

# fastchat's "vicuna_v1.1" conversation, which LongBench's pred.py uses for LongChat/Vicuna.
_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                  "The assistant gives helpful, detailed, and polite answers to the user's questions.")

CHAT_FORMATS = ("template", "none", "lwm", "longchat", "mistral", "llama2")


def format_chat(tokenizer, prompt: str, chat_format: str) -> tuple[str, bool]:
    """``(text, add_special_tokens)``: the text to tokenize and whether the tokenizer adds BOS.

    - ``template``: the tokenizer's own chat template (one user turn, generation prompt).
    - ``none``: the raw prompt after BOS. SnapKV's pred_snap.py feeds Mistral-7B-Instruct-v0.2 and
      Mixtral-8x7B-Instruct-v0.1 this way (its ``[INST]`` wrapper is commented out).
    - ``llama2``: ``[INST]{prompt}[/INST]`` after BOS, no spaces: LongBench pred.py for Llama-2
      chat, and SnapKV's pred_snap.py for LWM-Text-Chat-1M (its build_chat matches "lwm" there).
    - ``longchat``: fastchat's ``vicuna_v1.1`` conversation (LongBench pred.py and pred_snap.py).
    - ``lwm``: LWM's own chat format from the LWM release (not what the SnapKV paper's LongBench
      runs used).
    - ``mistral``: Mistral's ``[INST] {prompt} [/INST]`` with spaces (its own chat template).
    """
    if chat_format == "none":
        return prompt, True
    if chat_format == "template":
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("model.chat_format=template but the tokenizer has no chat template; "
                             f"choose one of {', '.join(CHAT_FORMATS)}")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return text, False
    if chat_format == "lwm":
        return f"You are a helpful assistant. USER: {prompt} ASSISTANT: ", True
    if chat_format == "longchat":
        return f"{_VICUNA_SYSTEM} USER: {prompt} ASSISTANT:", True
    if chat_format == "mistral":
        return f"[INST] {prompt} [/INST]", True
    if chat_format == "llama2":
        return f"[INST]{prompt}[/INST]", True
    check_choice("model.chat_format", chat_format, CHAT_FORMATS)
    raise AssertionError(f"chat_format {chat_format!r} is listed but not built")


def encode_chat(tokenizer, prompt: str, chat_format: str) -> list[int]:
    text, special = format_chat(tokenizer, prompt, chat_format)
    return tokenizer(text, add_special_tokens=special).input_ids


def encode_chat_split(tokenizer, prompt: str, chat_format: str, question_at: int,
                      suffix: str = "") -> tuple[list[int], int]:
    """``(ids, question_tokens)``: the ids ``encode_chat`` gives (``suffix`` appended after the
    wrapper, e.g. RULER's answer prefix), and how many of the last ones hold the question part,
    ``prompt[question_at:]`` and whatever the wrapper adds after the prompt (with
    ``query_aware=false`` they are appended uncompressed after the compressed context)."""
    if not 0 <= question_at <= len(prompt):
        raise ValueError(f"question_at={question_at} is outside the prompt ({len(prompt)} characters)")
    text, special = format_chat(tokenizer, prompt, chat_format)
    question = prompt[question_at:]
    start = text.find(prompt)
    boundary = start + question_at if start >= 0 else text.rfind(question) if question else len(text)
    if boundary < 0:
        raise InputError(f"model.chat_format={chat_format!r}: the wrapped prompt does not contain the question "
                         "part as written, so it cannot be split; use query_aware=true")
    return split_at(tokenizer, text + suffix, special, boundary)


def split_at(tokenizer, text: str, add_special_tokens: bool, boundary: int) -> tuple[list[int], int]:
    """``(ids, question_tokens)`` of ``text``: the tokens from the one that ends past character
    ``boundary`` on are the question part. A token that straddles the boundary goes with the
    question, so the context part never holds question text."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = list(encoded.input_ids), encoded.offset_mapping
    # special tokens (BOS) have empty spans at 0; the first token ending past the boundary starts the question
    first = next((i for i, (lo, hi) in enumerate(offsets) if hi > boundary and hi > lo), len(ids))
    return ids, len(ids) - first


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]) + [getattr(tokenizer, "eos_token_id", None)]:
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids


def encode_kvpress(tokenizer, context: str, question: str, answer_prefix: str, chat_format: str,
                   enable_thinking: bool = False, format_field: str = "model.chat_format"):
    """``(ids, question_tokens)`` as kvpress 0.5.5's ``KVPressTextGenerationPipeline.preprocess`` builds them,
    or None for a chat format kvpress has no counterpart of (the caller wraps it its own way).

    ``template``: the user turn is ``context + separator``, the chat template is applied (``enable_thinking``:
    False is the pipeline's default) and split at the separator; the context ids are the text before it, the
    question ids ``question + the rest + answer_prefix``, each tokenized on its own without special tokens.
    ``none`` (kvpress: a tokenizer without a chat template): BOS + context, then
    ``question + "\\n" + answer_prefix``. ``format_field``: the setting a missing template's error names."""
    if chat_format == "template":
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("model.chat_format=template but the tokenizer has no chat template; use "
                             f"{format_field}=none (kvpress's rule for such a tokenizer)")
        separator = "#" * (len(context) + 10)
        wrapped = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                                add_generation_prompt=True, tokenize=False,
                                                enable_thinking=enable_thinking)
        head, suffix = wrapped.split(separator)
    elif chat_format == "none":
        head, suffix = (getattr(tokenizer, "bos_token", None) or "") + context, "\n"
    else:
        return None
    context_ids = tokenizer.encode(head, add_special_tokens=False)
    question_ids = tokenizer.encode(question + suffix + answer_prefix, add_special_tokens=False)
    return list(context_ids) + list(question_ids), len(question_ids)

