"""python -m eval.needle: the needle-in-a-haystack grid for a model and a compressor (Hydra app)."""
from __future__ import annotations

from snapkv.errors import InputError, check_choice

import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ..chat import CHAT_FORMATS, stop_token_ids
from .. import engine
from ..gridcells import GridTask, key
from ..hydra_app import output_dir, resolve_device, run_guarded, task_main, typed_text
from ..jsonl import read_records
from .build import Needle, check_prompt, insert_needles, needle_depths, overhead_tokens, prompt_split_ids, \
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
    needle = cfg.needle
    if needle.get("haystack") is None:
        raise InputError("needle.haystack is required here: a folder of .txt files (the paper used Paul Graham's "
                         "essays), 'noise', or longbench:<dataset>:<dir>; set needle.haystack=DIR or NEEDLE_HAYSTACK")
    texts = {}
    for name in ("needle", "question", "answer"):
        texts[name] = typed_text(needle.get(name), f"needle.{name}")
        if not texts[name].strip():
            raise InputError(f"needle.{name} must be non-empty text")
    extra = []
    for i, item in enumerate(needle.get("extra_needles") or []):
        if not hasattr(item, "get") or item.get("needle") is None or item.get("answer") is None:
            raise InputError(f"needle.extra_needles[{i}] must be a mapping {{needle: ..., answer: ...}}")
        extra.append(Needle(typed_text(item.needle, f"needle.extra_needles[{i}].needle"),
                            typed_text(item.answer, f"needle.extra_needles[{i}].answer")))
    chat_format = needle.get("chat_format") or cfg.model.chat_format
    check_choice("needle.chat_format", chat_format, CHAT_FORMATS)
    max_new = numbers(needle.max_new_tokens, "needle.max_new_tokens")[0]
    if max_new < 1:
        raise InputError(f"needle.max_new_tokens={max_new} must be >= 1")
    return NeedleTask([Needle(texts["needle"], texts["answer"])] + extra, texts["question"],
                      typed_text(needle.haystack, "needle.haystack"), check_prompt(needle.get("prompt", "plain")),
                      chat_format, check_scorer(needle.get("scorer", "recall")), max_new,
                      bool(needle.get("stop_at_newline", False)))


def task_settings(task: NeedleTask) -> dict:
    """The needle fields as read and checked (text as typed, the haystack folder resolved, the chat
    format the model's when unset); they replace the raw fields in the fingerprint (``eval.settings``)."""
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
        raise InputError(f"needle.lengths: {short} are not longer than the prompt's fixed part ({overhead} tokens: "
                         f"template, question and needles); the shortest usable length is {overhead + 1}")


class NeedleGrid(GridTask):
    """The needle grid on the task engine: a cell's prompt is the haystack cut to its length with the
    needles inserted at its depth; its score is the response's recall (or exact match) of the answer."""

    name = "needle"
    section = "needle"
    results_file = "needle.jsonl"
    result_names = ("needle.jsonl",)
    splits_question = True

    def check(self, cfg) -> None:
        self.task = read_task(cfg)

    def settings(self, cfg) -> dict:
        return task_settings(self.task)

    def grid(self, cfg):
        return lengths_from(cfg.needle), depths_from(cfg.needle)

    def prepare(self, cfg, tokenizer, pending_items) -> None:
        task = self.task
        self.tokenizer = tokenizer
        self.overhead = overhead_tokens(tokenizer, task.needles, task.question, task.chat_format, task.prompt)
        check_lengths(sorted({c.length for c in pending_items}), self.overhead)
        started = time.perf_counter()
        self.stream = haystack_tokens(tokenizer, task.haystack, max(c.length for c in pending_items) - self.overhead)
        self.ends = sentence_end_ids(tokenizer, self.stream)
        print(f"needle: haystack of {len(self.stream)} tokens tokenized in {time.perf_counter() - started:.2f} s")

    def generation(self, model, tokenizer):
        stops = stop_token_ids(model, tokenizer)
        if self.task.stop_at_newline:
            stops.append(tokenizer.encode("\n", add_special_tokens=False)[-1])
        return self.task.max_new_tokens, stops

    def build(self, cell):
        task, tokenizer = self.task, self.tokenizer
        haystack = self.stream[: cell.length - self.overhead]
        context, points = insert_needles(tokenizer, haystack, task.needles,
                                         needle_depths(cell.depth, len(task.needles)), self.ends)
        ids, question = prompt_split_ids(tokenizer, context, task.question, task.chat_format, task.prompt)
        return ids, {"needle_token_position": points[0],
                     "depth_achieved": round(100 * points[0] / len(haystack), 2)}, question

    def score(self, response, fields):
        scores = cell_scores(response, self.task.needles)
        return {"score": scores[self.task.scorer], **scores}

    def finish(self, run):
        cfg, compressor, out = run.cfg, run.compressor, run.out
        cells = read_records(out / self.results_file)
        frontier = cfg.needle.get("full_kv_frontier") or full_kv_frontier(cfg, compressor, cells, out)
        save_heatmap(cells, out / "heatmap.png", f"{cfg.model.name} · {compressor.label()}", frontier,
                     cfg.model.get("trained_context"))
        scored = [c for c in cells if c.get("score") is not None]
        mean = sum(c["score"] for c in scored) / len(scored) if scored else float("nan")
        print(f"needle: {len(cells)} cells, mean {self.task.scorer} {mean:.3f}, "
              f"{sum(1 for c in cells if c.get('oom'))} OOM, {sum(1 for c in cells if c.get('failed'))} failed "
              f"-> {out / 'heatmap.png'}")
        return mean


def run(cfg: DictConfig):
    if cfg.needle.get("dry_run"):  # reads the folders, writes plan.json only (it may run on a login node)
        from .plan import dry_run
        task = read_task(cfg)  # noqa: F841 (checks the fields)
        lengths, depths = lengths_from(cfg.needle), depths_from(cfg.needle)
        results = [dry_run(one.cfg, one.compressor, lengths, depths,
                           {key(c) for c in read_records(one.out / "needle.jsonl")}, output_dir(one.cfg),
                           resolve_device(cfg)) for one in engine.job_settings(cfg)]
        return results[0] if len(results) == 1 else results
    return engine.run(NeedleGrid(), cfg)


def full_kv_frontier(cfg, compressor, cells: list[dict], out: Path) -> int | None:
    """Where full KV ran out: this run's own OOM cells, or those of a full-KV run beside it."""
    if not compressor.compresses:
        return frontier_from_cells(cells)
    sibling = out.parent / "full" / "needle.jsonl"
    return frontier_from_cells(read_records(sibling)) if sibling.exists() else None


@task_main("needle")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
