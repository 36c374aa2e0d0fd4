"""``bench.speculative.enabled``: the SnapKV paper's section 5 question, speculative decoding over a compressed cache.

For each prompt length and setting (full KV, then each method at ``budget``): plain greedy decoding, prompt-lookup
decoding (``prompt_lookup_num_tokens=lookup_tokens``) and, given ``draft_model`` (a conf/model name), assisted
generation, each writing ``decode_tokens`` tokens inside ``snapkv.compress`` (``docs/decoding.md``). The prompts are
a copy-heavy LongBench task's: multi_news articles (``data_dir``), their last ``length`` tokens followed by the
instruction to summarise. Per row: the target model's forward passes, tokens per pass, seconds and tokens per
second of the whole generation (the prefill included), and whether the tokens equal plain greedy's (they must: greedy
speculative decoding is exact). Every row is measured in one run, so the speed-ups compare on one machine.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import snapkv
from snapkv.errors import InputError

from ..decoding import sync

INSTRUCTION = "\n\nNow, write a one-page summary of all the news.\n\nSummary:"


def settings_of(node) -> list[snapkv.Method]:
    if int(node.decode_tokens) < 2 or int(node.lookup_tokens) < 1:
        raise InputError(f"bench.speculative: decode_tokens={node.decode_tokens} must be at least 2 and "
                         f"lookup_tokens={node.lookup_tokens} at least 1")
    return [snapkv.FullKV()] + [snapkv.build_config(str(method), budget=int(node.budget)) for method in node.methods]


def prompts(tokenizer, node, device) -> dict[int, torch.Tensor]:
    """Per length: one multi_news prompt's ids, the articles' last tokens then the instruction."""
    path = Path(str(node.data_dir)) / "multi_news.jsonl"
    if not path.exists():
        raise InputError(f"bench.speculative.data_dir={node.data_dir}: no multi_news.jsonl there")
    record = json.loads(path.read_text(encoding="utf-8").splitlines()[int(node.item)])
    context = tokenizer(record["context"].replace("NEWLINE_CHAR", "\n"), add_special_tokens=False).input_ids
    tail = tokenizer(INSTRUCTION, add_special_tokens=False).input_ids
    out = {}
    for length in node.lengths:
        keep = int(length) - len(tail)
        if keep < 1 or keep > len(context):
            raise InputError(f"bench.speculative.lengths: {length} tokens is outside what item {node.item} gives "
                             f"({len(tail) + 1}..{len(context) + len(tail)})")
        out[int(length)] = torch.tensor([context[-keep:] + tail], device=device)
    return out


def generate_once(model, cfg, ids: torch.Tensor, decode_tokens: int, **speculation) -> tuple[torch.Tensor, int, float]:
    """The tokens, the target model's forward passes and the seconds of one generation inside ``compress``."""
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with torch.inference_mode(), snapkv.compress(model, cfg):
            sync(ids.device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False,
                                 **speculation)
            sync(ids.device)
            seconds = time.perf_counter() - start
    finally:
        hook.remove()
    return out[0, ids.shape[1]:], len(calls), seconds


def measure_speculative(model, by_length: dict, node, draft=None) -> dict:
    """Every row (module docstring) for the prompts ``by_length`` (length -> ids ``[1, length]``)."""
    settings = settings_of(node)
    decode_tokens = int(node.decode_tokens)
    ways = {"greedy": {}, "prompt_lookup": {"prompt_lookup_num_tokens": int(node.lookup_tokens)}}
    if draft is not None:
        ways["assisted"] = {"assistant_model": draft}
    rows = []
    for length, ids in by_length.items():
        for cfg in settings:
            greedy = None
            for way, speculation in ways.items():
                print(f"speculative: {length} tokens, {cfg.label()}, {way}", flush=True)
                tokens, passes, seconds = generate_once(model, cfg, ids, decode_tokens, **speculation)
                if greedy is None:
                    greedy = (tokens, seconds)
                rows.append({"length": length, "setting": cfg.label(), "method": cfg.method, "decoding": way,
                             "passes": passes, "tokens_per_pass": round(decode_tokens / passes, 3),
                             "seconds": round(seconds, 4), "tokens_per_s": round(decode_tokens / seconds, 2),
                             "speedup_vs_greedy": round(greedy[1] / seconds, 3),
                             "equals_greedy": bool(torch.equal(tokens, greedy[0]))})
    return {"decode_tokens": decode_tokens, "lookup_tokens": int(node.lookup_tokens), "budget": int(node.budget),
            "item": getattr(node, "item", None), "rows": rows}


def markdown(result: dict, title: str) -> str:
    source = "repetitive random prompts" if result["item"] is None else f"multi_news item {result['item']}"
    lines = [f"# {title}", "",
             f"{source}, "
             f"{result['decode_tokens']} tokens written greedily; prompt lookup of "
             f"{result['lookup_tokens']} tokens; the compressed settings at budget {result['budget']}. Passes: the "
             "target model's forward passes (the prefill included); seconds: the whole generation.", "",
             "| prompt tokens | setting | decoding | passes | tokens/pass | seconds | tokens/s | vs greedy | "
             "equals greedy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | {r['setting']} | {r['decoding']} | {r['passes']} | {r['tokens_per_pass']:.2f} "
                     f"| {r['seconds']:.3f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_greedy']:.2f}x | "
                     f"{'yes' if r['equals_greedy'] else 'NO'} |")
    return "\n".join(lines) + "\n"
