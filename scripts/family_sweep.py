"""Every causal-LM family transformers ships, tried as a new user would: exact or refused in one line, never wrong.

For each ``model_type`` of transformers' causal-LM mapping (or the ones given): a tiny random model (the common
configuration of tests/test_families.py: 3 layers, 4 query and 2 KV heads, eager attention; a 64-token prompt) is
compressed with SnapKV (budget 40, window 8, ``gqa="repeat"``) and its kept positions are compared, on every
compressed layer, with the official selection made from the model's own attention weights. Each family runs in a
forked child (its memory capped, a time limit), so one that allocates too much or hangs is only reported.

Outcomes: ``exact``; ``refused`` (the one-line InputError, quoted); ``held`` (every layer a sliding one the model's
own cache holds whole at this length: nothing compressed, nothing to compare); ``no-weights`` (the model returns no
attention weights to compare with); ``wrong`` (kept positions differ: a bug); ``crash`` (an error that is not a
one-line refusal: a bug); ``no-model`` (the tiny configuration does not build or run a plain forward on its own:
not ours).

    python scripts/family_sweep.py                      # every family, about 8 minutes on a 2-core machine
    python scripts/family_sweep.py llama gemma2 bloom   # some
    python scripts/family_sweep.py --out results/measured/family_sweep

Writes ``family_sweep.json`` and ``family_sweep.md`` (a table and the counts) to ``--out`` when given.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENGTH, WINDOW, BUDGET, KERNEL = 64, 8, 40, 5
MEMORY_BYTES, SECONDS = 8 * 2**30, 90


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def official_kept(weights, layer: int):
    """Per query head, the positions the official ``update_kv`` keeps from layer ``layer``'s attention weights."""
    import torch.nn.functional as F
    votes = weights[layer][:, :, -WINDOW:, :-WINDOW].float().sum(dim=-2)
    pooled = F.max_pool1d(votes, kernel_size=KERNEL, padding=KERNEL // 2, stride=1)
    top = pooled.topk(BUDGET - WINDOW, dim=-1).indices[0]
    return [set(head.tolist()) | set(range(LENGTH - WINDOW, LENGTH)) for head in top]


def try_family(model_type: str) -> dict:
    """One family's outcome (module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    import snapkv
    ids = torch.randint(3, 100, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    try:
        config = AutoConfig.for_model(model_type, **COMMON)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            model(ids)
    except Exception as error:  # noqa: BLE001 - the tiny configuration is not one this family takes
        return {"outcome": "no-model", "detail": f"{type(error).__name__}: {str(error)[:120]}"}
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL, gqa="repeat")
    try:
        with torch.no_grad(), snapkv.compress(model, cfg) as session:
            model(ids, cache=DynamicCache(config=model.config), use_cache=True)
            kept = snapkv.kept_positions(session.caches[0])
    except snapkv.InputError as error:
        return {"outcome": "refused", "detail": str(error)}
    except Exception as error:  # noqa: BLE001 - reported: a bug to fix
        where = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(error.__traceback__)
                 if "snapkv" in f.filename][-2:]
        return {"outcome": "crash", "detail": f"{type(error).__name__}: {str(error)[:120]} {where}"}
    try:
        with torch.no_grad():
            weights = model(ids, output_attentions=True).attentions
    except Exception as error:  # noqa: BLE001 - nothing to compare with
        weights, why = None, f"{type(error).__name__}: {str(error)[:100]}"
    if not weights or any(w is None for w in weights):
        return {"outcome": "no-weights", "detail": "the model returns no attention weights" +
                (f" ({why})" if weights is None else "")}
    compared = wrong = 0
    for layer, per_row in enumerate(kept[:len(weights)]):
        heads = per_row[0]
        if len(heads[0]) != BUDGET:
            continue  # a sliding layer (or one the prompt fits): held as the model holds it
        want = official_kept(weights, layer)
        compared += 1
        if len(want) != len(heads):
            wrong += len(heads)
            continue
        wrong += sum(set(got.tolist()) != w for got, w in zip(heads, want))
    if not compared:
        return {"outcome": "held", "detail": "every layer held as the model's sliding cache holds it"}
    return {"outcome": "exact" if not wrong else "wrong",
            "detail": f"{compared} compressed layers" + (f", {wrong} heads differ" if wrong else "")}


def in_child(model_type: str) -> dict:
    """``try_family`` in a forked child, its memory capped and its time limited."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
        signal.alarm(SECONDS)
        try:
            result = try_family(model_type)
        except BaseException as error:  # noqa: BLE001 - whatever stops it, reported
            result = {"outcome": "crash", "detail": f"{type(error).__name__}: {str(error)[:120]}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"outcome": "no-model", "detail": f"the child stopped (status {status}): memory or time limit"}
    return json.loads(b"".join(chunks))


def report(results: dict) -> str:
    counts = Counter(r["outcome"] for r in results.values())
    lines = ["| outcome | families |", "|---|---|"]
    lines += [f"| {outcome} | {counts[outcome]} |" for outcome in
              ("exact", "refused", "held", "no-weights", "wrong", "crash", "no-model") if counts[outcome]]
    lines += ["", "| model_type | outcome | detail |", "|---|---|---|"]
    for model_type, result in results.items():
        detail = result["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{model_type}` | {result['outcome']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*", help="model types to try (default: every causal-LM one)")
    parser.add_argument("--out", type=Path, help="folder for family_sweep.json and family_sweep.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging
    logging.set_verbosity_error()
    import torch
    torch.set_num_threads(1)
    import snapkv  # noqa: F401 (imported once, before the children fork)
    results = {}
    for model_type in args.model_types or causal_lm_types():
        results[model_type] = in_child(model_type)
        print(f"{model_type}: {results[model_type]['outcome']}: {results[model_type]['detail'][:110]}", flush=True)
    counts = Counter(r["outcome"] for r in results.values())
    print(", ".join(f"{outcome} {n}" for outcome, n in counts.most_common()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "family_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "family_sweep.md").write_text(report(results))
    return 1 if counts["wrong"] or counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
