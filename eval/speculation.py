"""Speculative decoding in the task harness (``decoding.speculative``; the SnapKV paper's section 5).

Every task's greedy loop (``eval.decoding.greedy_rows``) can verify drafted tokens in one pass over the compressed
cache, then roll back the rejected ones (``CacheState.crop``): greedy, it writes plain greedy's tokens, with fewer
passes where drafts are accepted. Two drafters, as transformers has them:

- ``prompt_lookup`` (Saxena, "Prompt Lookup Decoding", 2023; transformers' ``PromptLookupCandidateGenerator``): the
  last ``ngram`` tokens (then fewer, down to one) of the prompt and the answer so far are looked up in that same
  sequence; the ``draft_tokens`` tokens that followed their first occurrence are the drafts, cut before a stop id;
- ``assistant`` (transformers' assisted generation with a fixed ``num_assistant_tokens``): a smaller model of the same
  vocabulary (``assistant``, a ``conf/model`` name) writes ``draft_tokens`` greedily over its own full cache of the
  prompt, which it crops to what the target accepted before it drafts again.

A pass never carries more tokens than are left to write, nor more than a setting cutting while decoding takes
before its next cut (``snapkv.tokens_before_cut``). The options count in the run's fingerprint (``decoding.*``,
where speculative is not none) and its folder name (``-lookup10``, ``-assisted10-NAME``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from snapkv.errors import InputError, check_choice

SPECULATIVE = ("none", "prompt_lookup", "assistant")


@dataclass(frozen=True)
class SpeculationOptions:
    """``cfg.decoding``, checked."""
    speculative: str = "none"
    draft_tokens: int = 10        # drafts a pass verifies at most (transformers: prompt_lookup_num_tokens)
    ngram: int = 2                # prompt lookup's longest n-gram (transformers: max_matching_ngram_size)
    assistant: str | None = None  # the draft model, a conf/model name

    @property
    def on(self) -> bool:
        return self.speculative != "none"

    def settings(self) -> dict:
        """The fingerprint's ``decoding.*`` (none where it does not speculate: folders made before stay valid)."""
        if not self.on:
            return {}
        out = {"decoding.speculative": self.speculative, "decoding.draft_tokens": self.draft_tokens}
        if self.speculative == "prompt_lookup":
            out["decoding.ngram"] = self.ngram
        else:
            out["decoding.assistant"] = self.assistant
        return out


def speculation_options(cfg) -> SpeculationOptions:
    """``cfg.decoding`` checked, one line naming the field and what it allows."""
    node = cfg.get("decoding") or {}
    kind = node.get("speculative", "none")
    if kind is None or kind is False:
        kind = "none"
    check_choice("decoding.speculative", kind, SPECULATIVE)
    draft_tokens, ngram = (counted(node, name, default) for name, default in (("draft_tokens", 10), ("ngram", 2)))
    assistant = node.get("assistant")
    if kind == "assistant" and not assistant:
        raise InputError("decoding.assistant: speculative=assistant needs the draft model, a conf/model name "
                         "(e.g. decoding.assistant=smollm2-135m)")
    if assistant is not None and kind != "assistant":
        raise InputError(f"decoding.assistant={assistant!r} is set but decoding.speculative={kind}; set "
                         "speculative=assistant or leave assistant null")
    return SpeculationOptions(kind, draft_tokens, ngram, None if assistant is None else str(assistant))


def plain_decoding_only(cfg, task: str, instead: str) -> None:
    """A task that decodes plainly (or not at all) refuses ``decoding.speculative`` in one line."""
    if speculation_options(cfg).on:
        raise InputError(f"decoding.speculative={cfg.decoding.speculative}: {task} does not take it; {instead}")


def counted(node, name: str, default: int) -> int:
    value = node.get(name, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"decoding.{name}={value!r} is not allowed; give a positive integer")
    return value


def decoding_suffix(node) -> str:
    """The run folder's suffix for speculative decoding: ``""``, ``-lookup10`` (``-lookup10-ngram3`` for another
    n-gram) or ``-assisted10-NAME``, so runs of other options never share a folder."""
    node = node or {}
    kind = node.get("speculative", "none")
    if kind in (None, False, "none"):
        return ""
    tokens = node.get("draft_tokens", 10)
    if kind == "prompt_lookup":
        ngram = node.get("ngram", 2)
        return f"-lookup{tokens}" + (f"-ngram{ngram}" if str(ngram) != "2" else "")
    return f"-assisted{tokens}-{node.get('assistant')}"


def first_starts(tokens: list[int], ngram: int, ends) -> list[dict]:
    """Per n-gram size up to ``ngram``: each n-gram of ``tokens`` ending at one of ``ends`` (exclusive) and where it
    first starts."""
    first = [{} for _ in range(ngram + 1)]
    for end in ends:
        for size in range(1, min(ngram, end) + 1):
            first[size].setdefault(tuple(tokens[end - size:end]), end - size)
    return first


class PromptIndex:
    """Where each n-gram of a prompt first starts: built once per prompt, shared by every row drafting from it (the
    settings of a shared prefill), and freed with the last of them."""

    def __init__(self, prompt: list[int], ngram: int):
        self.tokens = list(prompt)
        self.first = first_starts(self.tokens, ngram, range(1, len(self.tokens) + 1))


_INDEXES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def prompt_index(prompt: list[int], ngram: int) -> PromptIndex:
    key = (tuple(prompt), ngram)
    index = _INDEXES.get(key)
    if index is None:
        index = _INDEXES[key] = PromptIndex(prompt, ngram)
    return index


class PromptLookup:
    """Prompt-lookup drafts for one row: ``drafts(written, most, stop)``, ``written`` the answer so far (it only
    grows). Where each n-gram first occurs is indexed (the prompt's once, ``PromptIndex``; those reaching into the
    answer as it grows), so a lookup costs the same at any prompt length. An n-gram inside the prompt starts before
    any reaching into the answer, so the prompt's index is read first."""

    def __init__(self, prompt: list[int], draft_tokens: int, ngram: int):
        self.draft_tokens, self.ngram = draft_tokens, ngram
        self.index = prompt_index(prompt, ngram)
        self.sequence = list(self.index.tokens)  # the prompt, then the answer so far
        self.first = [{} for _ in range(ngram + 1)]  # the n-grams reaching into the answer

    def drafts(self, written: list[int], most: int, stop=frozenset()) -> list[int]:
        known = len(self.sequence)
        self.sequence += written[known - len(self.index.tokens):]
        for size, first in enumerate(first_starts(self.sequence, self.ngram, range(known + 1, len(self.sequence) + 1))):
            for gram, start in first.items():
                self.first[size].setdefault(gram, start)
        sequence, length = self.sequence, len(self.sequence)
        for size in range(min(self.ngram, length - 1), 0, -1):
            # the first occurrence with tokens after it: an n-gram first seen at the end has none, nor any later one
            tail = tuple(sequence[length - size:])
            start = self.index.first[size].get(tail, self.first[size].get(tail)) + size
            if start < length:
                return before_stop(sequence[start:start + min(self.draft_tokens, most)], stop)
        return []


def before_stop(tokens: list[int], stop) -> list[int]:
    """The drafts before the first stop id: a stop is written as the target's own token, never verified as a draft."""
    for k, token in enumerate(tokens):
        if token in stop:
            return tokens[:k]
    return tokens


class AssistantDrafts:
    """A draft model's greedy drafts for one row, over its own full cache of the prompt and the accepted tokens."""

    def __init__(self, model, prompt: list[int], draft_tokens: int):
        from transformers import DynamicCache
        self.model, self.prompt, self.draft_tokens = model, list(prompt), draft_tokens
        self.cache = DynamicCache(config=model.config)
        self.cache.activate_past_recording()  # a sliding-window layer can give back drafts it has let go of
        self.fed: list[int] | None = None  # the answer's tokens its cache holds after the prompt (None: nothing yet)

    @torch.inference_mode()
    def drafts(self, written: list[int], most: int, stop=frozenset()) -> list[int]:
        """``written``: the answer so far, never empty (the target writes its first token before any draft)."""
        most = min(self.draft_tokens, most)
        if most < 1:
            return []
        if self.fed is None:
            feed, self.fed = self.prompt + written, list(written)
        else:
            same = 0
            for mine, theirs in zip(self.fed, written):
                if mine != theirs:
                    break
                same += 1
            same = min(same, len(written) - 1)  # the last token is fed again for the next logits
            self.cache.crop(same - len(self.fed))  # also holds a sliding layer to its window again
            feed = written[same:]
            self.fed = self.fed[:same] + feed
        device = next(self.model.parameters()).device
        out = []
        while True:
            logits = self.model(torch.tensor([feed], device=device), cache=self.cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            if token in stop:
                break
            out.append(token)
            if len(out) == most:
                break
            feed = [token]
            self.fed.append(token)
        return out


def drafting(options: SpeculationOptions, assistant=None):
    """``prompt ids -> a row's drafter`` for ``options`` (None: no speculation); ``assistant``: the loaded draft
    model for ``speculative=assistant``."""
    if options.speculative == "prompt_lookup":
        return lambda prompt: PromptLookup(prompt, options.draft_tokens, options.ngram)
    if options.speculative == "assistant":
        return lambda prompt: AssistantDrafts(assistant, prompt, options.draft_tokens)
    return None


def load_assistant(options: SpeculationOptions, target_tokenizer, device):
    """The draft model of ``speculative=assistant`` (None otherwise); its vocabulary must be the target's."""
    if options.speculative != "assistant":
        return None
    from .runner import load_model, model_config
    model, tokenizer = load_model(model_config(options.assistant, "decoding.assistant"), device)
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise InputError(f"decoding.assistant={options.assistant}: its tokenizer's vocabulary is not the target "
                         "model's; a draft model must share it")
    return model
