"""python -m eval.needle: the needle-in-a-haystack grid for a model and a compressor (Hydra app)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ..chat import CHAT_FORMATS, stop_token_ids
from ..hydra_app import CONFIG_PATH, clear_failure, make_compressor, output_dir, resolve_device, run_guarded, \
    save_run_metadata, typed_text
from ..gridcells import Prompt, key, load_cells, run_grid
from ..jsonl import read_records
from ..settings import claim, fingerprint
from .build import Needle, check_prompt, insert_needles, needle_depths, overhead_tokens, prompt_ids, \
    sentence_end_ids
from .grid import depths_from, lengths_from, numbers
from .haystack import haystack_tokens
from .heatmap import frontier_from_cells, save_heatmap
from .score import cell_scores, check_scorer


@dataclass
class NeedleTask:
    needles: list[Needle]
    question: str
    haystack: str
    prompt: str
    chat_format: str
    scorer: str
    max_new_tokens: int
    stop_at_newline: bool


def read_task(cfg) -> NeedleTask:
    """The needle fields, each accepted as typed on the command line (numbers are text here)."""
    nc = cfg.needle
    if nc.get("haystack") is None:
        raise ValueError("needle.haystack is required here: a folder of .txt files (the paper used Paul Graham's "
                         "essays), 'noise', or longbench:<dataset>:<dir>; set needle.haystack=DIR or NEEDLE_HAYSTACK")
    texts = {}
    for name in ("needle", "question", "answer"):
        texts[name] = typed_text(nc.get(name), f"needle.{name}")
        if not texts[name].strip():
            raise ValueError(f"needle.{name} must be non-empty text")
    extra = []
    for i, item in enumerate(nc.get("extra_needles") or []):
        if not hasattr(item, "get") or item.get("needle") is None or item.get("answer") is None:
            raise ValueError(f"needle.extra_needles[{i}] must be a mapping {{needle: ..., answer: ...}}")
        extra.append(Needle(typed_text(item.needle, f"needle.extra_needles[{i}].needle"),
                            typed_text(item.answer, f"needle.extra_needles[{i}].answer")))
    chat_format = nc.get("chat_format") or cfg.model.chat_format
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"needle.chat_format={chat_format!r} is not allowed; choose one of {', '.join(CHAT_FORMATS)}")
    max_new = numbers(nc.max_new_tokens, "needle.max_new_tokens")[0]
    if max_new < 1:
        raise ValueError(f"needle.max_new_tokens={max_new} must be >= 1")
    return NeedleTask([Needle(texts["needle"], texts["answer"])] + extra, texts["question"],
                      typed_text(nc.haystack, "needle.haystack"), check_prompt(nc.get("prompt", "plain")),
                      chat_format, check_scorer(nc.get("scorer", "recall")), max_new,
                      bool(nc.get("stop_at_newline", False)))


def task_settings(task: NeedleTask) -> dict:
    """Needle fields that change a cell. The grid is not one of them: cells are keyed by (length,
    depth) and a cell does not depend on the others, so a grid can be extended in place."""
    haystack = task.haystack
    if haystack != "noise" and not haystack.startswith("longbench:"):
        haystack = str(Path(haystack).resolve())
    return {"needle.haystack": haystack, "needle.needles": [[n.text, n.answer] for n in task.needles],
            "needle.question": task.question, "needle.prompt": task.prompt, "needle.chat_format": task.chat_format,
            "needle.scorer": task.scorer, "needle.max_new_tokens": task.max_new_tokens,
            "needle.stop_at_newline": task.stop_at_newline}


def check_lengths(lengths: list[int], overhead: int) -> None:
    short = [n for n in lengths if n <= overhead]
    if short:
        raise ValueError(f"needle.lengths: {short} are not longer than the prompt's fixed part ({overhead} tokens: "
                         f"template, question and needles); the shortest usable length is {overhead + 1}")


def run(cfg: DictConfig):
    compressor = make_compressor(cfg.compressor)
    task = read_task(cfg)
    nc = cfg.needle
    lengths, depths = lengths_from(nc), depths_from(nc)
    out = output_dir(cfg)
    results = out / "needle.jsonl"
    device = resolve_device(cfg)
    if nc.get("dry_run"):  # reads the folder, writes plan.json only (it may run on a login node)
        from .plan import dry_run
        return dry_run(cfg, compressor, lengths, depths, {key(c) for c in read_records(results)}, out, device)
    claim(out, fingerprint(cfg, task_settings(task)), cfg.resume, ["needle.jsonl"])
    clear_failure(out)
    cells = load_cells(results, bool(nc.get("retry_oom")), bool(nc.get("retry_failed")))
    done = {key(c) for c in cells}
    todo = [(n, d) for n in lengths for d in depths if (n, d) not in done]
    if todo:
        run_cells(cfg, task, compressor, todo, depths, cells, results, device)
    cells = read_records(results)
    frontier = nc.get("full_kv_frontier") or full_kv_frontier(cfg, compressor, cells, out)
    save_heatmap(cells, out / "heatmap.png", f"{cfg.model.name} · {compressor.label()}", frontier, cfg.model.get("trained_context"))
    scored = [c for c in cells if c.get("score") is not None]
    mean = sum(c["score"] for c in scored) / len(scored) if scored else float("nan")
    print(f"needle: {len(cells)} cells, mean {task.scorer} {mean:.3f}, {sum(1 for c in cells if c.get('oom'))} OOM, "
          f"{sum(1 for c in cells if c.get('failed'))} failed -> {out / 'heatmap.png'}")
    return mean


def full_kv_frontier(cfg, compressor, cells: list[dict], out: Path) -> int | None:
    """Where full KV ran out: this run's own OOM cells, or those of a full-KV run beside it."""
    if not compressor.compresses:
        return frontier_from_cells(cells)
    sibling = out.parent / "full" / "needle.jsonl"
    return frontier_from_cells(read_records(sibling)) if sibling.exists() else None


def run_cells(cfg, task: NeedleTask, compressor, todo, depths, cells, results: Path, device: str) -> None:
    from ..runner import Runner, load_model, load_tokenizer
    tokenizer = load_tokenizer(cfg.model)
    overhead = overhead_tokens(tokenizer, task.needles, task.question, task.chat_format, task.prompt)
    check_lengths(sorted({n for n, _ in todo}), overhead)
    save_run_metadata(cfg, results.parent, compressor)
    started = time.perf_counter()
    stream = haystack_tokens(tokenizer, task.haystack, max(n for n, _ in todo) - overhead)
    ends = sentence_end_ids(tokenizer, stream)
    print(f"needle: haystack of {len(stream)} tokens tokenized in {time.perf_counter() - started:.2f} s")
    model, _ = load_model(cfg.model, device, with_tokenizer=False)
    runner = Runner(model, tokenizer, mlp_chunk=cfg.model.get("mlp_chunk"))
    stops = stop_token_ids(model, tokenizer)
    if task.stop_at_newline:
        stops.append(tokenizer.encode("\n", add_special_tokens=False)[-1])

    def build(length, depth):
        haystack = stream[: length - overhead]
        context, points = insert_needles(tokenizer, haystack, task.needles,
                                         needle_depths(depth, len(task.needles)), ends)
        ids = prompt_ids(tokenizer, context, task.question, task.chat_format, task.prompt)
        return Prompt(ids, {"needle_token_position": points[0],
                            "depth_achieved": round(100 * points[0] / len(haystack), 2)})

    def score(response, prompt):
        scores = cell_scores(response, task.needles)
        return {"score": scores[task.scorer], **scores}

    run_grid(runner, tokenizer, compressor, todo, depths, cells, results, build=build, score=score,
             max_new_tokens=task.max_new_tokens, stops=stops, skip_after_oom=cfg.needle.get("skip_after_oom", True),
             desc="needle")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="needle")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
