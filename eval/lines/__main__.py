"""python -m eval.lines: LongEval-Lines retrieval over token limits x depths (Hydra app).

Shares the needle task's grid machinery: one resumable line a cell, OOM lengths skipped and
retried, cells of a killed process recorded as failures, the paper-style heatmap."""
from __future__ import annotations

from omegaconf import DictConfig

from .. import engine
from ..chat import CHAT_FORMATS, stop_token_ids
from ..gridcells import GridTask
from ..hydra_app import run_guarded, task_main
from ..jsonl import read_records
from ..needle.grid import depths_from, lengths_from, numbers
from ..needle.heatmap import save_heatmap
from .generate import LinesPrompts, exact_value
from snapkv.errors import InputError


def task_settings(chat_format: str) -> dict:
    """The resolved chat format (null: the model's); the rest of ``cfg.lines`` counts as typed."""
    return {"lines.chat_format": chat_format}


class LinesGrid(GridTask):
    """LongEval-Lines on the task engine: a cell's prompt holds as many lines as fit its length, and asks
    for the line at its depth; the score is an exact match of the asked value."""

    name = "lines"
    section = "lines"
    results_file = "lines.jsonl"
    result_names = ("lines.jsonl",)

    def check(self, cfg) -> None:
        lc = cfg.lines
        numbers([lc.seed, lc.pool, lc.max_new_tokens], "lines.seed/pool/max_new_tokens")
        self.chat_format = lc.get("chat_format") or cfg.model.chat_format
        if self.chat_format not in CHAT_FORMATS:
            raise InputError(f"lines.chat_format={self.chat_format!r} is not allowed; "
                             f"choose one of {', '.join(CHAT_FORMATS)}")

    def settings(self, cfg) -> dict:
        return task_settings(self.chat_format)

    def grid(self, cfg):
        return lengths_from(cfg.lines), depths_from(cfg.lines)

    def prepare(self, cfg, tokenizer, pending_items) -> None:
        lc = cfg.lines
        self.prompts = LinesPrompts(tokenizer, self.chat_format, int(lc.seed), int(lc.pool))
        for length in sorted({c.length for c in pending_items}):
            self.prompts.count_for(length)  # every length is checked before the model loads
        self.max_new_tokens = int(lc.max_new_tokens)

    def generation(self, model, tokenizer):
        return self.max_new_tokens, stop_token_ids(model, tokenizer)

    def build(self, cell):
        ids, asked, index, count = self.prompts.build(cell.length, cell.depth)
        return ids, {"lines": count, "asked_line": index, "key": asked.key, "expected": asked.value}, 0

    def score(self, response, fields):
        return {"score": exact_value(response, fields["expected"])}

    def finish(self, run):
        cells = read_records(run.out / self.results_file)
        title = f"{run.cfg.model.name} · LongEval-Lines · {run.compressor.label()}"
        save_heatmap(cells, run.out / "heatmap.png", title, None, None)
        scored = [c["score"] for c in cells if c.get("score") is not None]
        accuracy = sum(scored) / len(scored) if scored else float("nan")
        print(f"lines: {len(cells)} cells, accuracy {accuracy:.3f} -> {run.out / 'heatmap.png'}")
        return accuracy


def run(cfg: DictConfig):
    return engine.run(LinesGrid(), cfg)


@task_main("lines")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
