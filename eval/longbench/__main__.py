"""python -m eval.longbench: predict and score LongBench with a model and a compressor (Hydra app)."""
from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ..hydra_app import CONFIG_PATH, clear_failure, make_compressor, output_dir, resolve_device, run_guarded, \
    save_run_metadata
from ..jsonl import write_json_atomic
from ..settings import claim, fingerprint
from .data import check_dataset, data_source, dataset_file, file_digest, read_dataset
from .predict import pending_rows, pred_path, predict_dataset
from .prompt import PROTOCOLS, check_protocol
from .score import write_scores

DATASETS_FILE = "datasets.json"


def check_task(lb) -> None:
    for name in ("limit", "max_new_tokens"):
        value = lb.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"longbench.{name}={value!r} must be a positive integer (or null)")
    if not lb.get("revision"):
        raise ValueError("longbench.revision must name a revision of the hub dataset (a commit, tag or branch)")


def task_settings(cfg) -> dict:
    lb = cfg.longbench
    return {"longbench.max_new_tokens": lb.max_new_tokens,
            "longbench.data_source": data_source(lb.data_dir, str(lb.revision))}


def record_datasets(out: Path, files: dict) -> dict:
    """Per dataset: the data file's digest and row count. A dataset whose data changed under
    existing predictions is refused (the fingerprint covers the folder, this covers each file)."""
    path = out / DATASETS_FILE
    known = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    for dataset, info in files.items():
        old = known.get(dataset)
        if old and old["sha256"] != info["sha256"] and pred_path(out, dataset).exists():
            raise ValueError(f"longbench.datasets: {dataset} data changed under existing predictions in {out} "
                             f"(sha256 {old['sha256']} -> {info['sha256']}); pass resume=restart or another output_dir")
        known[dataset] = info
    write_json_atomic(path, known)
    return known


def run(cfg: DictConfig) -> dict:
    from ..runner import Runner, load_model
    compressor = make_compressor(cfg.compressor)
    lb = cfg.longbench
    check_task(lb)
    check_protocol(cfg.model.get("protocol", "longbench"))
    datasets = [check_dataset(d) for d in lb.datasets]
    sources = {d: dataset_file(d, lb.data_dir, str(lb.revision)) for d in datasets}
    out = output_dir(cfg)
    claim(out, fingerprint(cfg, task_settings(cfg)), cfg.resume, ["pred", "pred_e"])
    clear_failure(out)
    data = {d: read_dataset(path) for d, path in sources.items()}
    record_datasets(out, {d: {"rows": len(data[d]), "sha256": file_digest(sources[d]), "file": str(sources[d])}
                          for d in datasets})
    work = {d: pending_rows(data[d][: lb.limit] if lb.limit else data[d], pred_path(out, d), lb.retry_oom)
            for d in datasets}
    if any(work.values()):
        save_run_metadata(cfg, out, compressor, {"protocol": cfg.model.protocol,
                                                 "protocol_source": PROTOCOLS[cfg.model.protocol]})
        model, tokenizer = load_model(cfg.model, resolve_device(cfg))
        runner = Runner(model, tokenizer, mlp_chunk=cfg.model.get("mlp_chunk"))
        for dataset, rows in work.items():
            if rows:
                predict_dataset(runner, dataset, rows, pred_path(out, dataset), cfg.model, compressor,
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
