"""python -m eval.lines: LongEval-Lines retrieval over token limits x depths (Hydra app).

Shares the needle task's grid machinery: one resumable line a cell, OOM lengths skipped and
retried, cells of a killed process recorded as failures, the paper-style heatmap."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ..chat import CHAT_FORMATS, stop_token_ids
from ..gridcells import Prompt, key, load_cells, run_grid
from ..hydra_app import CONFIG_PATH, clear_failure, make_compressor, output_dir, resolve_device, run_guarded, \
    save_run_metadata
from ..jsonl import read_records
from ..needle.grid import depths_from, lengths_from, numbers
from ..needle.heatmap import save_heatmap
from ..settings import claim, fingerprint
from .generate import LinesPrompts, exact_value


def task_settings(lc, chat_format: str) -> dict:
    return {"lines.seed": lc.seed, "lines.pool": lc.pool, "lines.chat_format": chat_format,
            "lines.max_new_tokens": lc.max_new_tokens}


def run(cfg: DictConfig):
    from ..runner import Runner, load_model, load_tokenizer
    compressor = make_compressor(cfg.compressor)
    lc = cfg.lines
    numbers([lc.seed, lc.pool, lc.max_new_tokens], "lines.seed/pool/max_new_tokens")
    chat_format = lc.get("chat_format") or cfg.model.chat_format
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"lines.chat_format={chat_format!r} is not allowed; choose one of {', '.join(CHAT_FORMATS)}")
    lengths, depths = lengths_from(lc), depths_from(lc)
    out = output_dir(cfg)
    claim(out, fingerprint(cfg, task_settings(lc, chat_format)), cfg.resume, ["lines.jsonl"])
    clear_failure(out)
    results = out / "lines.jsonl"
    cells = load_cells(results, bool(lc.get("retry_oom")), bool(lc.get("retry_failed")))
    done = {key(c) for c in cells}
    todo = [(n, d) for n in lengths for d in depths if (n, d) not in done]
    if todo:
        tokenizer = load_tokenizer(cfg.model)
        prompts = LinesPrompts(tokenizer, chat_format, int(lc.seed), int(lc.pool))
        for length in sorted({n for n, _ in todo}):
            prompts.count_for(length)  # every length is checked before the model loads
        save_run_metadata(cfg, out, compressor)
        model, _ = load_model(cfg.model, resolve_device(cfg), with_tokenizer=False)
        runner = Runner(model, tokenizer, mlp_chunk=cfg.model.get("mlp_chunk"))

        def build(length, depth):
            ids, asked, index, count = prompts.build(length, depth)
            return Prompt(ids, {"lines": count, "asked_line": index, "key": asked.key, "expected": asked.value})

        def score(response, prompt):
            return {"score": exact_value(response, prompt.fields["expected"])}

        run_grid(runner, tokenizer, compressor, todo, depths, cells, results, build=build, score=score,
                 max_new_tokens=int(lc.max_new_tokens), stops=stop_token_ids(model, tokenizer),
                 skip_after_oom=lc.get("skip_after_oom", True), desc="lines")
    cells = read_records(results)
    title = f"{cfg.model.name} · LongEval-Lines · {compressor.label()}"
    save_heatmap(cells, out / "heatmap.png", title, None, None)
    scored = [c["score"] for c in cells if c.get("score") is not None]
    accuracy = sum(scored) / len(scored) if scored else float("nan")
    print(f"lines: {len(cells)} cells, accuracy {accuracy:.3f} -> {out / 'heatmap.png'}")
    return accuracy


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="lines")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
