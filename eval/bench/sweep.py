"""``bench.sweep``: what shared prefill saves on a sweep, measured in one run.

For a task's real prompts (LongBench rows) and a list of compressor settings, three ways are timed
in one process, one after another, on the same prompts:
- solo: one ``generate`` per setting and prompt (a prefill each), as a sweep of solo jobs runs them
  (without the model loads, which a solo sweep adds on top);
- shared: one ``generate_shared`` per prompt (one prefill, each setting's own scoring and decode);
- ideal: one forward, each setting's own scoring, every decode, added up from the solo runs
  (full's prefill, plus each setting's prefill beyond full's, plus every decode).

Every setting's tokens from the shared run are compared with its solo run's (they must be equal).
Each method's prefill relative to full's shows what its scoring costs. Times are wall-clock in the
process as users run it (no allocator settings), so the ratios, not the seconds, carry over.
"""
from __future__ import annotations

from snapkv.config import InputError

import statistics
import time

import snapkv

from ..runner import _sync

PRESETS = {
    # SnapKV Table 1: full, SnapKV 1024/2048/4096 (window 32, kernel 7, max pooling), H2O 4096
    "table1": [{"method": "full"}, {"method": "snapkv", "budget": 1024}, {"method": "snapkv", "budget": 2048},
               {"method": "snapkv", "budget": 4096}, {"method": "h2o", "budget": 4096}],
    # SnapKV's hyperparameter table: budget 1024; windows 16/32/64 at kernel 7, kernels 1/5/9 at window 32
    "hyperparams": [{"method": "snapkv", "budget": 1024, "window": w, "kernel": k}
                    for w, k in ((32, 7), (16, 7), (64, 7), (32, 5), (32, 9), (32, 1))],
}


def settings_of(spec) -> list:
    """Compressor configs from a preset name or a list of ``{method, field: value}`` mappings; each
    budget may be scaled by ``scale`` (a demo-sized run of a preset)."""
    entries = PRESETS.get(spec) if isinstance(spec, str) else spec
    if entries is None:
        raise InputError(f"bench.sweep.settings={spec!r} is not allowed; choose one of {', '.join(PRESETS)} "
                         "or a list of {method: ..., budget: ...}")
    out = []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        if "method" not in entry:
            raise InputError(f"bench.sweep.settings[{i}] needs a method")
        out.append(snapkv.build_config(entry.pop("method"), **entry))
    return out


def scaled(cfgs: list, scale: float) -> list:
    if scale == 1:
        return cfgs
    out = []
    for cfg in cfgs:
        if not cfg.compresses:
            out.append(cfg)
            continue
        values = cfg.describe()
        method = values.pop("method")
        for derived in cfg.derived:
            values.pop(derived, None)
        values["budget"] = max(int(values["budget"] * scale), values.get("window", 0) + 1, 2)
        out.append(snapkv.build_config(method, **values))
    return out


def measure_sweep(runner, prompts: list, settings: list) -> dict:
    """``prompts``: ``[(ids tensor [1, L], max_new_tokens, stop_ids, min_new_tokens)]``."""
    device = runner.device
    labels = [cfg.label() for cfg in settings]
    first = prompts[0]
    runner.generate(first[0][:, :64], snapkv.FullConfig(), 2)  # warm-up: kernels, thread pools
    solo = {label: {"prefill_s": [], "decode_s": [], "tokens": []} for label in labels}
    _sync(device)
    started = time.perf_counter()
    for ids, n_new, stops, min_new in prompts:
        for cfg, label in zip(settings, labels):
            gen = runner.generate(ids, cfg, n_new, stop_ids=stops, min_new_tokens=min_new)
            solo[label]["prefill_s"].append(gen.prefill_s)
            solo[label]["decode_s"].append(gen.decode_s)
            solo[label]["tokens"].append(gen.tokens)
    _sync(device)
    solo_s = time.perf_counter() - started
    shared = {label: {"decode_s": [], "tokens": []} for label in labels}
    shared_prefill = []
    started = time.perf_counter()
    for ids, n_new, stops, min_new in prompts:
        gens = runner.generate_shared(ids, settings, n_new, stop_ids=stops, min_new_tokens=min_new)
        shared_prefill.append(gens[0].prefill_s)
        for label, gen in zip(labels, gens):
            shared[label]["decode_s"].append(gen.decode_s)
            shared[label]["tokens"].append(gen.tokens)
    _sync(device)
    shared_s = time.perf_counter() - started
    full_label = next((label for cfg, label in zip(settings, labels) if not cfg.compresses), None)
    base = solo[full_label]["prefill_s"] if full_label else None
    if base is None:  # no full setting: the cheapest prefill stands for the forward pass
        base = [min(solo[label]["prefill_s"][i] for label in labels) for i in range(len(prompts))]
    scoring = sum(max(0.0, solo[label]["prefill_s"][i] - base[i]) for label in labels for i in range(len(prompts)))
    decode = sum(sum(solo[label]["decode_s"]) for label in labels)
    ideal_s = sum(base) + scoring + decode
    rows = []
    for label in labels:
        rows.append({"setting": label,
                     "prefill_relative_to_full": round(statistics.median(
                         p / b for p, b in zip(solo[label]["prefill_s"], base)), 2),
                     "solo_prefill_s": round(sum(solo[label]["prefill_s"]), 3),
                     "solo_decode_s": round(sum(solo[label]["decode_s"]), 3),
                     "shared_decode_s": round(sum(shared[label]["decode_s"]), 3),
                     "tokens_equal": solo[label]["tokens"] == shared[label]["tokens"]})
    return {"prompts": len(prompts), "input_tokens": [int(p[0].shape[1]) for p in prompts],
            "answer_tokens": [len(t) for t in solo[labels[0]]["tokens"]], "settings": labels,
            "solo_s": round(solo_s, 3), "shared_s": round(shared_s, 3), "ideal_s": round(ideal_s, 3),
            "shared_prefill_s": round(sum(shared_prefill), 3),
            "speedup": round(solo_s / shared_s, 2), "shared_over_ideal": round(shared_s / ideal_s, 3),
            "exact": all(r["tokens_equal"] for r in rows), "rows": rows,
            "decode_together": "not built yet: settings decode one after another from their own caches"}


def markdown(result: dict, title: str) -> str:
    lines = [f"# {title}", "",
             f"{result['prompts']} prompt(s) of {', '.join(map(str, result['input_tokens']))} tokens, "
             f"{len(result['settings'])} settings.", "",
             "| run | wall s | vs solo |", "|---|---|---|",
             f"| solo (one prefill per setting) | {result['solo_s']} | 1.00x |",
             f"| shared prefill, exact | {result['shared_s']} | {result['speedup']:.2f}x |",
             f"| ideal (one forward, each scoring, every decode) | {result['ideal_s']} | "
             f"{result['solo_s'] / result['ideal_s']:.2f}x |", "",
             f"Shared is {100 * (result['shared_over_ideal'] - 1):+.1f}% from the ideal; every setting's tokens equal "
             f"its solo run's: {'yes' if result['exact'] else 'NO'}.", "",
             "| setting | prefill / full's | solo prefill s | solo decode s | shared decode s | tokens equal |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['setting']} | {r['prefill_relative_to_full']:.2f} | {r['solo_prefill_s']} | "
                     f"{r['solo_decode_s']} | {r['shared_decode_s']} | {'yes' if r['tokens_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"
