"""python -m eval.needle: the needle-in-a-haystack grid for a model and a compressor (Hydra app)."""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from ..chat import stop_token_ids
from ..hydra_app import CONFIG_PATH, clear_failure, make_compressor, output_dir, resolve_device, run_guarded, \
    save_run_metadata
from ..jsonl import append_record, read_records
from ..runner import is_oom
from ..settings import claim, fingerprint
from .build import Needle, insert_needles, needle_depths, overhead_tokens, prompt_ids, sentence_end_ids
from .grid import depths_from, lengths_from
from .haystack import haystack_tokens
from .heatmap import save_heatmap
from .score import exact_score, recall_score


def needles_of(cfg) -> list[Needle]:
    for key in ("needle", "question", "answer"):
        if not str(cfg.get(key) or "").strip():
            raise ValueError(f"needle.{key} must be a non-empty string")
    extra = [Needle(str(n["needle"]), str(n["answer"])) for n in (cfg.extra_needles or [])]
    return [Needle(cfg.needle, cfg.answer)] + extra


def task_settings(nc) -> dict:
    """Needle fields that change a cell. The grid is not one of them: cells are keyed by (length,
    depth) and a cell does not depend on the others, so a grid can be extended in place."""
    haystack = str(nc.haystack)
    if haystack not in ("noise",) and not haystack.startswith("longbench:"):
        haystack = str(Path(haystack).resolve())
    return {"needle.haystack": haystack, "needle.needle": nc.needle, "needle.question": nc.question,
            "needle.answer": nc.answer, "needle.extra_needles": nc.extra_needles,
            "needle.max_new_tokens": nc.max_new_tokens}


def title_of(cfg, compressor) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in compressor.describe().items() if k != "method" and v is not None)
    return f"{cfg.model.name} · {compressor.method}" + (f" ({settings})" if compressor.compresses else "")


def run(cfg: DictConfig):
    from ..runner import Runner, load_model
    compressor = make_compressor(cfg.compressor)
    nc = cfg.needle
    needles = needles_of(nc)
    lengths, depths = lengths_from(nc), depths_from(nc)
    out = output_dir(cfg)
    claim(out, fingerprint(cfg, task_settings(nc)), cfg.resume, ["needle.jsonl"])
    clear_failure(out)
    results = out / "needle.jsonl"
    done = {(r["context_length"], r["depth_percent"]) for r in read_records(results, repair=True)}
    todo = [(n, d) for n in lengths for d in depths if (n, d) not in done]
    if todo:
        save_run_metadata(cfg, out, compressor)
        model, tokenizer = load_model(cfg.model, resolve_device(cfg))
        runner = Runner(model, tokenizer, mlp_chunk=cfg.model.get("mlp_chunk"))
        stops = stop_token_ids(model, tokenizer)
        overhead = overhead_tokens(tokenizer, needles, nc.question, cfg.model.chat_format)
        stream = haystack_tokens(tokenizer, str(nc.haystack), max(lengths) - overhead)
        ends = sentence_end_ids(tokenizer, stream)
        bar = tqdm(todo, desc="needle", unit="cell", dynamic_ncols=True)
        for length, depth in bar:
            bar.set_postfix(length=length, depth=depth)
            context, points = insert_needles(tokenizer, stream[: length - overhead], needles,
                                             needle_depths(depth, len(needles)), ends)
            ids = prompt_ids(tokenizer, context, nc.question, cfg.model.chat_format)
            cell = {"context_length": length, "depth_percent": depth, "input_tokens": len(ids),
                    "needle_token_position": points[0]}
            try:
                gen = runner.generate(torch.tensor([ids]), compressor, int(nc.max_new_tokens), stop_ids=stops)
                tokens = gen.tokens[:-1] if gen.tokens and gen.tokens[-1] in stops else gen.tokens
                response = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                cell.update(response=response,
                            score=sum(recall_score(response, n.answer) for n in needles) / len(needles),
                            exact=sum(exact_score(response, n.answer) for n in needles) / len(needles),
                            oom=False, prefill_s=round(gen.prefill_s, 4),
                            cache_tokens=max(gen.cache_lengths) if gen.cache_lengths else None)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                cell.update(response=None, score=None, exact=None, oom=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            append_record(results, cell)
    cells = read_records(results)
    save_heatmap(cells, out / "heatmap.png", title_of(cfg, compressor), cfg.model.get("trained_context"))
    scored = [c for c in cells if not c.get("oom")]
    mean = sum(c["score"] for c in scored) / len(scored) if scored else float("nan")
    print(f"needle: {len(cells)} cells, mean score {mean:.3f}, {len(cells) - len(scored)} OOM -> {out / 'heatmap.png'}")
    return mean


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="needle")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
