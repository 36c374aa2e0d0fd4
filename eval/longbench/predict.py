"""Predict LongBench datasets with a model and a compressor, resumable one line at a time."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..chat import stop_token_ids
from ..jsonl import append_record, read_records, rewrite_records
from ..runner import is_oom
from .prompt import build_input_ids, extra_stop_ids, generation_length, min_new_tokens


def pred_path(run_dir: Path, dataset: str) -> Path:
    """Where a dataset's predictions go, laid out as official ``eval.py`` reads them: LongBench v1
    in ``pred/<dataset>.jsonl``, LongBench-E in ``pred_e/<dataset without _e>.jsonl`` (``--e``)."""
    if dataset.endswith("_e"):
        return Path(run_dir) / "pred_e" / f"{dataset[:-2]}.jsonl"
    return Path(run_dir) / "pred" / f"{dataset}.jsonl"


def pending_rows(rows: list[dict], path: Path, retry_oom: bool = False) -> list[dict]:
    """Rows that have no prediction line yet (with ``retry_oom``, also those that ran out of memory,
    whose old lines are dropped first so that the file never holds two lines of one sample)."""
    records = read_records(path, repair=True)
    if retry_oom and any(r.get("oom") for r in records):
        records = [r for r in records if not r.get("oom")]
        rewrite_records(path, records)
    finished = {r.get("_id") for r in records}
    return [r for r in rows if r["_id"] not in finished]


def predict_dataset(runner, dataset: str, rows: list[dict], path: Path, model_cfg, compressor,
                    max_new_tokens=None) -> int:
    """Append one prediction line per row; returns how many rows ran out of memory."""
    tokenizer = runner.tokenizer
    stops = stop_token_ids(runner.model, tokenizer) + extra_stop_ids(tokenizer, dataset)
    min_new = min_new_tokens(dataset, model_cfg.protocol)
    n_new = generation_length(dataset, max_new_tokens)
    ooms, tokens_seen, started = 0, 0, time.perf_counter()
    bar = tqdm(rows, desc=dataset, unit="sample", dynamic_ncols=True)
    for row in bar:
        ids = build_input_ids(tokenizer, row, dataset, int(model_cfg.max_length), model_cfg.chat_format)
        record = {"_id": row["_id"], "pred": "", "answers": row["answers"], "all_classes": row["all_classes"],
                  "length": row["length"]}
        try:
            out = runner.generate(torch.tensor([ids]), compressor, n_new, stop_ids=stops, min_new_tokens=min_new)
            generated = out.tokens[:-1] if out.tokens and out.tokens[-1] in stops else out.tokens
            record["pred"] = tokenizer.decode(generated, skip_special_tokens=True)
            record["input_tokens"] = len(ids)
        except Exception as exc:
            if not is_oom(exc):
                raise
            ooms += 1
            record.update(oom=True, input_tokens=len(ids))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        append_record(path, record)
        tokens_seen += len(ids)
        bar.set_postfix(tok_s=f"{tokens_seen / (time.perf_counter() - started):.0f}", oom=ooms)
    return ooms
