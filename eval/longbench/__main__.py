"""python -m eval.longbench: predict and score LongBench with a model and a compressor (Hydra app)."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ..hydra_app import CONFIG_PATH, clear_failure, make_compressor, output_dir, resolve_device, run_guarded, \
    save_run_metadata
from .data import check_dataset
from .predict import pending_rows, predict_dataset
from .score import write_scores


def run(cfg: DictConfig) -> dict:
    from ..runner import Runner, load_model
    compressor = make_compressor(cfg.compressor)
    out = output_dir(cfg)
    clear_failure(out)
    lb = cfg.longbench
    datasets = [check_dataset(d) for d in lb.datasets]
    if lb.limit is not None and int(lb.limit) < 1:
        raise ValueError(f"longbench.limit={lb.limit} must be a positive number of rows (or null)")
    if lb.max_new_tokens is not None and int(lb.max_new_tokens) < 1:
        raise ValueError(f"longbench.max_new_tokens={lb.max_new_tokens} must be >= 1 (or null)")
    work = {d: pending_rows(d, lb.data_dir, lb.limit, out / "pred" / f"{d}.jsonl") for d in datasets}
    if any(work.values()):
        save_run_metadata(cfg, out, compressor)
        model, tokenizer = load_model(cfg.model, resolve_device(cfg))
        runner = Runner(model, tokenizer, mlp_chunk=cfg.model.get("mlp_chunk"))
        for dataset, rows in work.items():
            if rows:
                predict_dataset(runner, dataset, rows, out / "pred" / f"{dataset}.jsonl", cfg.model, compressor,
                                lb.max_new_tokens)
    else:
        print(f"{out}: every prediction is already there; scoring only")
    scores = write_scores(out)
    for dataset, score in scores.items():
        print(f"{dataset}: {score}")
    return scores


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="longbench")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
