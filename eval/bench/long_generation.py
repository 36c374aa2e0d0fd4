"""``bench.long_generation.enabled``: a long answer from a short prompt, full cache against cuts while decoding.

Each setting prefills the same short prompt (random ids, seeded) and writes ``decode_tokens`` tokens greedily
with ``eval.decoding``'s loop, none stopping early. Per token, the step's time (after a device sync); the table
gives the mean over the first and over the last ``span`` tokens and their ratio (a full cache grows, so its steps
slow down; a cut cache stays flat), the KV bytes held at the end, the peak above the weights (CUDA: allocated
memory; CPU: resident memory, read in this process) and the memory planner's prediction of that peak with its
error. Every setting is measured in one run, so the ratios compare on one machine.
"""
from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

import snapkv
from snapkv.errors import InputError
from snapkv.memory import plan

from ..decoding import Limits, Member, decode, sync
from ..runner import kv_bytes_per_token
from .measure import _cpu_rss, _reset_cpu_peak


def settings_of(node) -> list[snapkv.Method]:
    """FullKV, then each of ``methods`` with the prompt kept whole and the cache cut while decoding."""
    if int(node.span) < 1 or 2 * int(node.span) > int(node.decode_tokens):
        raise InputError(f"bench.long_generation.span={node.span}: allowed 1..decode_tokens/2 "
                         f"({int(node.decode_tokens) // 2})")
    out = [snapkv.FullKV()]
    for method in node.methods:
        out.append(snapkv.build_config(str(method), budget=None, ratio=0.0, decode_target=int(node.target),
                                       decode_interval=int(node.interval), decode_buffer=int(node.buffer)))
    return out


def measure_one(model, cfg, ids: torch.Tensor, decode_tokens: int, span: int, dtype: str) -> dict:
    device = ids.device
    cuda = device.type == "cuda"
    sync(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_cpu_peak()
        base = _cpu_rss("VmRSS")
    stamps = []

    def stamp(_kept: int) -> None:
        sync(device)
        stamps.append(time.perf_counter())
    with torch.inference_mode(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        sync(device)
        stamps.append(time.perf_counter())
        member = Member(cache, logits)
        limits = Limits(decode_tokens, frozenset(), decode_tokens, progress=stamp)
        for _batch, _tokens, _seconds in decode(model, [member], [[0]], limits):
            pass
        after = member.after or {}
        held = after.get("final_kv_bytes")
        if held is None:  # a cache not cut while decoding holds every token it was given
            held = (ids.shape[1] + decode_tokens - 1) * kv_bytes_per_token(model)
    peak = (torch.cuda.max_memory_allocated() if cuda else _cpu_rss("VmHWM")) - base
    steps = [b - a for a, b in zip(stamps, stamps[1:])][1:]  # each decoding step (the first comes from the prefill)
    first, last = statistics.mean(steps[:span]), statistics.mean(steps[-span:])
    planned = plan(model.config, ids.shape[1], cfg if cfg.compresses else None, decode_tokens=decode_tokens,
                   dtype=dtype, device=device.type, attn_implementation=model.config._attn_implementation)
    predicted = planned["decode_peak_bytes"] - planned["weights_bytes"]
    return {"setting": cfg.label(), "method": cfg.method, "first_ms_per_token": round(1000 * first, 3),
            "last_ms_per_token": round(1000 * last, 3), "last_over_first": round(last / first, 3),
            "final_kv_bytes": int(held), "decode_cuts": after.get("decode_cuts", 0),
            "decode_cut_s": after.get("decode_cut_s", 0.0), "peak_above_weights_bytes": int(peak),
            "planned_peak_above_weights_bytes": int(predicted),
            "planner_error": round((predicted - peak) / peak, 3) if peak > 0 else None}


def measure_long_generation(model, node, dtype: str) -> dict:
    settings = settings_of(node)
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (1, int(node.prompt_tokens)),
                        generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for cfg in settings:
        print(f"long generation: {cfg.label()}, {node.decode_tokens} tokens", flush=True)
        rows.append(measure_one(model, cfg, ids, int(node.decode_tokens), int(node.span), dtype))
    full = rows[0]
    for row in rows:
        row["final_kv_of_full"] = round(row["final_kv_bytes"] / full["final_kv_bytes"], 4)
        row["last_ms_vs_full"] = round(row["last_ms_per_token"] / full["last_ms_per_token"], 3)
    return {"prompt_tokens": int(node.prompt_tokens), "decode_tokens": int(node.decode_tokens),
            "span": int(node.span), "target": int(node.target), "interval": int(node.interval),
            "buffer": int(node.buffer), "rows": rows}


def markdown(result: dict, title: str) -> str:
    span = result["span"]
    lines = [f"# {title}", "",
             f"A {result['prompt_tokens']}-token prompt, {result['decode_tokens']} tokens written; cuts while decoding "
             f"to {result['target']} tokens every {result['interval']} (buffer {result['buffer']}). ms/token over the "
             f"first and the last {span} tokens; peak above the weights as measured and as planned.", "",
             "| setting | first ms/tok | last ms/tok | last/first | last vs full | KV at end MiB | of full | cuts "
             "| cut s | peak MiB | planned MiB | planner error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        error = "" if r["planner_error"] is None else f"{100 * r['planner_error']:+.1f}%"
        lines.append(f"| {r['setting']} | {r['first_ms_per_token']:.2f} | {r['last_ms_per_token']:.2f} | "
                     f"{r['last_over_first']:.2f}x | {r['last_ms_vs_full']:.2f}x | {r['final_kv_bytes'] / 2**20:.1f} | "
                     f"{100 * r['final_kv_of_full']:.1f}% | {r['decode_cuts']} | {r['decode_cut_s']:.3f} | "
                     f"{r['peak_above_weights_bytes'] / 2**20:.1f} | "
                     f"{r['planned_peak_above_weights_bytes'] / 2**20:.1f} | {error} |")
    return "\n".join(lines) + "\n"
