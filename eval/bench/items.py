"""``bench.batching``: items in flight (``batch.items``) against one item at a time, items per second
measured in one run.

A LongBench-shaped run: ``short`` rows of a short-answer dataset (hotpotqa's prompt and its 32-token
answers) and ``long`` rows of a long-answer one (multi_news, 512), each under every setting (Table 1's
five by default). The bundled sample holds three multi_news rows: the long rows are those, the short
rows are passages cut from their documents (different lengths) asked a question through hotpotqa's
template; the answers are the model's, so the run measures speed and agreement, not scores.

- one at a time: one shared prefill per item, its settings decoded one after another (``generate_shared``),
  what a job does at ``batch.items=1`` by default; and the same with the settings decoded together
  (``shared_prefill.decode_together=true``);
- in flight: the engine's batches (``eval.batching.cut_batches``: grouped by answer length, longest
  first, ``bench.batching.batch``: N or auto) through ``Runner.generate_items``
  (``bench.batching.prefill``), decoded together.

Both read the same prompts in the same process, one after the other; every item's tokens under every
setting are compared (batched arithmetic may round otherwise). The planner's peak for the largest batch
is reported beside the measured one where the device is a GPU (``max_memory_allocated``).
"""
from __future__ import annotations

import time

import torch

from ..batching import AutoSize, BatchOptions, Entry, cut_batches
from ..engine import Prompt
from ..decoding import sync
from .sweep import agreement

SHORT_DATASET, LONG_DATASET = "hotpotqa", "multi_news"
QUESTIONS = ("Which people does the passage name?", "What happened first in the passage?",
             "Where do the events of the passage take place?", "What is the passage mainly about?")


def item_rows(sample: list[dict], short: int, long: int) -> list[tuple[str, dict]]:
    """``(dataset, row)`` pairs: ``long`` multi_news rows (cycled) and ``short`` hotpotqa-style rows whose
    contexts are passages of those rows' documents, of different lengths."""
    rows = [(LONG_DATASET, sample[i % len(sample)]) for i in range(long)]
    for i in range(short):
        document = sample[i % len(sample)]["context"]
        words = document.split()
        size = min(len(words), 150 + 110 * i)
        start = (37 * i) % max(1, len(words) - size + 1)
        rows.append((SHORT_DATASET, {"context": " ".join(words[start:start + size]),
                                     "input": QUESTIONS[i % len(QUESTIONS)], "answers": [""],
                                     "_id": f"passage{i}"}))
    return rows


def one_at_a_time(runner, prompts: list[Prompt], settings: list,
                  together: bool) -> tuple[list[list[list[int]]], float]:
    tokens = []
    sync(runner.device)
    started = time.perf_counter()
    for p in prompts:
        gens = runner.generate_shared(torch.tensor([p.ids]), settings, p.max_new_tokens, stop_ids=p.stop_ids,
                                      min_new_tokens=p.min_new_tokens, together=together)
        tokens.append([g.tokens for g in gens])
    sync(runner.device)
    return tokens, time.perf_counter() - started


def in_flight(runner, prompts: list[Prompt], settings: list, size_for, prefill: str) -> tuple[list, float, list[int]]:
    entries = [Entry(i, p, ["all"]) for i, p in enumerate(prompts)]
    batches = cut_batches(entries, size_for)
    tokens = [None] * len(prompts)
    sync(runner.device)
    started = time.perf_counter()
    for batch in batches:
        first = batch[0].prompt
        gens = runner.generate_items([e.prompt.ids for e in batch], settings, first.max_new_tokens,
                                     stop_ids=first.stop_ids, min_new_tokens=first.min_new_tokens, together=True,
                                     prefill=prefill)
        for entry, per_setting in zip(batch, gens):
            tokens[entry.item] = [g.tokens for g in per_setting]
    sync(runner.device)
    return tokens, time.perf_counter() - started, [len(b) for b in batches]


def measure_items(runner, prompts: list[Prompt], settings: list, options: BatchOptions, model_cfg) -> dict:
    runner.generate(torch.tensor([prompts[0].ids[:64]]), settings[0], 2)  # warm-up: kernels, thread pools
    size_for = AutoSize(options, model_cfg, settings, runner.device, True) if options.items == "auto" \
        else (lambda length, answer: int(options.items))
    alone, alone_s = one_at_a_time(runner, prompts, settings, together=False)
    _, together_s = one_at_a_time(runner, prompts, settings, together=True)
    batched, batched_s, sizes = in_flight(runner, prompts, settings, size_for, options.prefill)
    flat_alone = [t for item in alone for t in item]  # the exact records: batch 1, settings one by one
    flat_batched = [t for item in batched for t in item]
    differ, same = agreement(flat_alone, flat_batched)
    answers = len(flat_alone)
    return {"items": len(prompts), "settings": [cfg.label() for cfg in settings],
            "input_tokens": [len(p.ids) for p in prompts], "answer_tokens": [len(t[0]) for t in alone],
            "batch_items": options.items, "batch_prefill": options.prefill, "batch_sizes": sizes,
            "one_at_a_time_s": round(alone_s, 3), "together_s": round(together_s, 3),
            "in_flight_s": round(batched_s, 3),
            "one_at_a_time_items_per_s": round(len(prompts) / alone_s, 4),
            "together_items_per_s": round(len(prompts) / together_s, 4),
            "in_flight_items_per_s": round(len(prompts) / batched_s, 4),
            "speedup": round(alone_s / batched_s, 2), "speedup_over_together": round(together_s / batched_s, 2),
            "answers": answers, "answers_equal": answers - differ,
            "answers_equal_share": round(1 - differ / answers, 4),
            "token_agreement": round(same, 4)}


def markdown(result: dict, title: str) -> str:
    return "\n".join([
        f"# {title}", "",
        f"{result['items']} items ({', '.join(map(str, result['input_tokens']))} tokens), "
        f"{len(result['settings'])} settings ({', '.join(result['settings'])}), batch.items={result['batch_items']}, "
        f"batch.prefill={result['batch_prefill']}: "
        f"batches of {', '.join(map(str, result['batch_sizes']))}.", "",
        "| run | wall s | items / s | vs one at a time |", "|---|---|---|---|",
        f"| one at a time (batch.items=1: shared prefill, settings one after another) | {result['one_at_a_time_s']} | "
        f"{result['one_at_a_time_items_per_s']} | 1.00x |",
        f"| one at a time, settings decoded together | {result['together_s']} | {result['together_items_per_s']} | "
        f"{result['one_at_a_time_s'] / result['together_s']:.2f}x |",
        f"| in flight (items and settings decoded together) | {result['in_flight_s']} | "
        f"{result['in_flight_items_per_s']} | {result['speedup']:.2f}x |", "",
        f"In flight against one at a time with the settings decoded together: {result['speedup_over_together']:.2f}x. "
        f"Answers equal to the one-at-a-time run's: {result['answers_equal']} of {result['answers']} "
        f"({100 * result['answers_equal_share']:.1f}%); {100 * result['token_agreement']:.1f}% of tokens agree.", ""])
