"""``bench.sweep``: what shared prefill saves on a sweep, measured in one run.

For a task's real prompts (LongBench rows) and a list of compressor settings, these ways are timed
in one process, one after another, on the same prompts:
- solo: one ``generate`` per setting and prompt (a prefill each), as a sweep of solo jobs runs them
  (without the model loads, which a solo sweep adds on top);
- shared: one ``generate_shared`` per prompt (one prefill, each setting's own scoring and decode);
- together: the same with ``together=True`` (the settings decode as batches);
- ideal: one forward, each setting's own scoring, every decode, added up from the solo runs
  (full's prefill, plus each setting's prefill beyond full's, plus every decode).

Every setting's tokens from the shared run are compared with its solo run's (they must be equal);
the together run's with the exact ones (how many answers and tokens differ).
Each method's prefill relative to full's shows what its scoring costs. Times are wall-clock in the
process as users run it (no allocator settings), so the ratios, not the seconds, carry over.
"""
from __future__ import annotations

from snapkv.errors import InputError

import statistics
import time

import snapkv

from .. import leaderboard
from ..decoding import sync

PRESETS = {
    # SnapKV Table 1: full, SnapKV 1024/2048/4096 (window 32, kernel 7, max pooling), H2O 4096
    "table1": [{"method": "full"}, {"method": "snapkv", "budget": 1024}, {"method": "snapkv", "budget": 2048},
               {"method": "snapkv", "budget": 4096}, {"method": "h2o", "budget": 4096}],
    # SnapKV's hyperparameter table: budget 1024; windows 16/32/64 at kernel 7, kernels 1/5/9 at window 32
    "hyperparams": [{"method": "snapkv", "budget": 1024, "window": w, "kernel": k}
                    for w, k in ((32, 7), (16, 7), (64, 7), (32, 5), (32, 9), (32, 1))],
    # the kvpress leaderboard's shape: full KV and every leaderboard method here at its four ratios
    "leaderboard": leaderboard.settings(),
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
        if not cfg.compresses or cfg.ratio is not None:  # a ratio already scales with the prompt
            out.append(cfg)
            continue
        values = cfg.describe()
        method = values.pop("method")
        for derived in cfg.derived:
            values.pop(derived, None)
        values["budget"] = max(int(values["budget"] * scale), values.get("window", 0) + 1, 2)
        out.append(snapkv.build_config(method, **values))
    return out


def _shared_run(runner, prompts: list, settings: list, labels: list, together: bool) -> tuple[dict, list, float]:
    """Per label its decode times and tokens, the shared prefills' times, and the wall time."""
    out = {label: {"decode_s": [], "tokens": []} for label in labels}
    prefills = []
    sync(runner.device)
    started = time.perf_counter()
    for ids, n_new, stops, min_new, question in prompts:
        gens = runner.generate_shared(ids, settings, n_new, stop_ids=stops, min_new_tokens=min_new,
                                      together=together, question_in_prompt=question)
        prefills.append(gens[0].prefill_s)
        for label, gen in zip(labels, gens):
            out[label]["decode_s"].append(gen.decode_s)
            out[label]["tokens"].append(gen.tokens)
    sync(runner.device)
    return out, prefills, time.perf_counter() - started


def agreement(exact: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """Answers that differ, and the fraction of token positions that agree (over the longer answer)."""
    differ = sum(a != b for a, b in zip(exact, other))
    same = sum(x == y for a, b in zip(exact, other) for x, y in zip(a, b))
    total = sum(max(len(a), len(b)) for a, b in zip(exact, other))
    return differ, same / max(total, 1)


def measure_sweep(runner, prompts: list, settings: list, together: bool = True) -> dict:
    """``prompts``: ``[(ids tensor [1, L], max_new_tokens, stop_ids, min_new_tokens, question_tokens)]``, the
    last ``question_tokens`` ids the question part (FINCH's window, ``Method.needs_question_length``)."""
    device = runner.device
    labels = [cfg.label() for cfg in settings]
    first = prompts[0]
    runner.generate(first[0][:, :64], snapkv.FullKV(), 2)  # warm-up: kernels, thread pools
    solo = {label: {"prefill_s": [], "decode_s": [], "tokens": []} for label in labels}
    sync(device)
    started = time.perf_counter()
    for ids, n_new, stops, min_new, question in prompts:
        for cfg, label in zip(settings, labels):
            gen = runner.generate(ids, cfg, n_new, stop_ids=stops, min_new_tokens=min_new,
                                  question_in_prompt=question)
            solo[label]["prefill_s"].append(gen.prefill_s)
            solo[label]["decode_s"].append(gen.decode_s)
            solo[label]["tokens"].append(gen.tokens)
    sync(device)
    solo_s = time.perf_counter() - started
    shared, shared_prefill, shared_s = _shared_run(runner, prompts, settings, labels, together=False)
    batched = _shared_run(runner, prompts, settings, labels, together=True) if together else None
    full_label = next((label for cfg, label in zip(settings, labels) if not cfg.compresses), None)
    base = solo[full_label]["prefill_s"] if full_label else None
    if base is None:  # no full setting: the cheapest prefill stands for the forward pass
        base = [min(solo[label]["prefill_s"][i] for label in labels) for i in range(len(prompts))]
    scoring = sum(max(0.0, solo[label]["prefill_s"][i] - base[i]) for label in labels for i in range(len(prompts)))
    decode = sum(sum(solo[label]["decode_s"]) for label in labels)
    ideal_s = sum(base) + scoring + decode
    rows = []
    for label in labels:
        extra = {}
        if batched:
            differ, same = agreement(shared[label]["tokens"], batched[0][label]["tokens"])
            extra = {"together_answers_differ": differ, "together_token_agreement": round(same, 4)}
        rows.append({**extra, "setting": label,
                     "prefill_relative_to_full": round(statistics.median(
                         p / b for p, b in zip(solo[label]["prefill_s"], base)), 2),
                     "solo_prefill_s": round(sum(solo[label]["prefill_s"]), 3),
                     "solo_decode_s": round(sum(solo[label]["decode_s"]), 3),
                     "shared_decode_s": round(sum(shared[label]["decode_s"]), 3),
                     "tokens_equal": solo[label]["tokens"] == shared[label]["tokens"]})
    result = {"prompts": len(prompts), "input_tokens": [int(p[0].shape[1]) for p in prompts],
            "answer_tokens": [len(t) for t in solo[labels[0]]["tokens"]], "settings": labels,
            "solo_s": round(solo_s, 3), "shared_s": round(shared_s, 3), "ideal_s": round(ideal_s, 3),
            "shared_prefill_s": round(sum(shared_prefill), 3),
            "solo_prefill_s": round(sum(sum(solo[label]["prefill_s"]) for label in labels), 3),
            "ideal_prefill_s": round(sum(base) + scoring, 3),
            "speedup": round(solo_s / shared_s, 2), "shared_over_ideal": round(shared_s / ideal_s, 3),
            "exact": all(r["tokens_equal"] for r in rows), "rows": rows}
    if batched:
        _, together_prefill, together_s = batched
        result.update(together_s=round(together_s, 3), together_speedup=round(solo_s / together_s, 2),
                      together_prefill_s=round(sum(together_prefill), 3),
                      together_answers_differ=sum(r["together_answers_differ"] for r in rows),
                      together_token_agreement=round(statistics.mean(r["together_token_agreement"] for r in rows), 4))
    return result


def markdown(result: dict, title: str) -> str:
    lines = [f"# {title}", "",
             f"{result['prompts']} prompt(s) of {', '.join(map(str, result['input_tokens']))} tokens, "
             f"{len(result['settings'])} settings.", "",
             "| run | wall s | prefill s | decode s | vs solo |", "|---|---|---|---|---|",
             _run_row("solo (one prefill per setting)", result["solo_s"], result["solo_prefill_s"], result),
             _run_row("shared prefill, exact", result["shared_s"], result["shared_prefill_s"], result)]
    if "together_s" in result:
        lines.append(_run_row("shared prefill, decoding together", result["together_s"],
                              result["together_prefill_s"], result))
    lines += [_run_row("ideal (one forward, each scoring, every decode)", result["ideal_s"],
                       result["ideal_prefill_s"], result), "",
              f"Shared is {100 * (result['shared_over_ideal'] - 1):+.1f}% from the ideal; every setting's tokens "
              f"equal its solo run's: {'yes' if result['exact'] else 'NO'}."]
    if "together_s" in result:
        lines.append(f"Decoding together: {result['together_answers_differ']} of "
                     f"{result['prompts'] * len(result['settings'])} answers differ from the exact mode; "
                     f"{100 * result['together_token_agreement']:.1f}% of tokens agree.")
    together = "together_s" in result
    lines += ["", "| setting | prefill / full's | solo prefill s | solo decode s | shared decode s | tokens equal |"
              + (" together: answers differ | token agreement |" if together else ""),
              "|---|---|---|---|---|---|" + ("---|---|" if together else "")]
    for r in result["rows"]:
        line = (f"| {r['setting']} | {r['prefill_relative_to_full']:.2f} | {r['solo_prefill_s']} | "
                f"{r['solo_decode_s']} | {r['shared_decode_s']} | {'yes' if r['tokens_equal'] else 'NO'} |")
        if together:
            line += f" {r['together_answers_differ']} | {100 * r['together_token_agreement']:.1f}% |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _run_row(name: str, wall: float, prefill: float, result: dict) -> str:
    return (f"| {name} | {wall} | {prefill} | {round(wall - prefill, 3)} | "
            f"{result['solo_s'] / wall:.2f}x |")
