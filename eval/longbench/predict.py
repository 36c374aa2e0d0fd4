"""LongBench as a prediction task of the engine: one line a row, resumable, per dataset file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..chat import stop_token_ids
from ..engine import PredictionTask, Prompt, SettingRun
from ..jsonl import append_record, read_records, rewrite_records, write_json_atomic
from .data import check_dataset, data_source, dataset_file, file_digest, read_dataset
from .prompt import PROTOCOLS, build_split_ids, check_protocol, extra_stop_ids, generation_length, min_new_tokens
from snapkv.errors import InputError


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


DATASETS_FILE = "datasets.json"


def check_task(longbench_cfg) -> None:
    for name in ("limit", "max_new_tokens"):
        value = longbench_cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"longbench.{name}={value!r} must be a positive integer (or null)")
    if not longbench_cfg.get("revision"):
        raise InputError("longbench.revision must name a revision of the hub dataset (a commit, tag or branch)")


def task_settings(cfg) -> dict:
    """What the fingerprint records for ``data_dir`` and ``revision`` (the rest of ``cfg.longbench``
    counts as typed, see ``eval.settings``)."""
    longbench_cfg = cfg.longbench
    return {"longbench.data_source": data_source(longbench_cfg.data_dir, str(longbench_cfg.revision))}


def record_datasets(out: Path, files: dict) -> dict:
    """Per dataset: the data file's digest and row count. A dataset whose data changed under
    existing predictions is refused (the fingerprint covers the folder, this covers each file)."""
    path = out / DATASETS_FILE
    known = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    for dataset, info in files.items():
        old = known.get(dataset)
        if old and old["sha256"] != info["sha256"] and pred_path(out, dataset).exists():
            raise InputError(f"longbench.datasets: {dataset} data changed under existing predictions in {out} "
                             f"(sha256 {old['sha256']} -> {info['sha256']}); pass resume=restart or another output_dir")
        known[dataset] = info
    write_json_atomic(path, known)
    return known


@dataclass
class Row:
    dataset: str
    row: dict

    @property
    def key(self):
        return self.dataset, self.row["_id"]


class LongBenchTask(PredictionTask):
    """The rows of the configured datasets; the prompt and generation rules of the model's protocol."""

    name = "longbench"
    result_names = ("pred", "pred_e")
    splits_question = True

    def check(self, cfg) -> None:
        longbench_cfg = cfg.longbench
        check_task(longbench_cfg)
        check_protocol(cfg.model.get("protocol", "longbench"))
        self.model_cfg, self.longbench_cfg = cfg.model, longbench_cfg
        self.datasets = [check_dataset(d) for d in longbench_cfg.datasets]
        self.sources = {d: dataset_file(d, longbench_cfg.data_dir, str(longbench_cfg.revision)) for d in self.datasets}
        self._stops: dict = {}

    def settings(self, cfg) -> dict:
        return task_settings(cfg)

    def items(self, cfg) -> list[Row]:
        data = {d: read_dataset(path) for d, path in self.sources.items()}
        self.files = {d: {"rows": len(data[d]), "sha256": file_digest(self.sources[d]), "file": str(self.sources[d])}
                      for d in self.datasets}
        limit = self.longbench_cfg.limit
        self.data = {d: rows[:limit] if limit else rows for d, rows in data.items()}
        return [Row(dataset, row) for dataset, rows in self.data.items() for row in rows]

    def open(self, run: SettingRun, items) -> set:
        record_datasets(run.out, self.files)
        pending = set()
        for dataset, rows in self.data.items():
            path = pred_path(run.out, dataset)
            pending |= {(dataset, r["_id"]) for r in pending_rows(rows, path, bool(self.longbench_cfg.retry_oom))}
        return pending

    def metadata(self, cfg) -> dict:
        return {"protocol": cfg.model.protocol, "protocol_source": PROTOCOLS[cfg.model.protocol]}

    def prompt(self, item: Row, model, tokenizer) -> Prompt:
        cfg = self.model_cfg
        dataset = item.dataset
        if dataset not in self._stops:
            self._stops[dataset] = stop_token_ids(model, tokenizer) + extra_stop_ids(tokenizer, dataset)
        ids, question = build_split_ids(tokenizer, item.row, dataset, int(cfg.max_length), cfg.chat_format)
        return Prompt(ids, generation_length(dataset, self.longbench_cfg.max_new_tokens), self._stops[dataset],
                      min_new_tokens(dataset, cfg.protocol), question_tokens=question)

    def record(self, run: SettingRun, item: Row, prompt: Prompt, generation, text) -> None:
        row = item.row
        record = {"_id": row["_id"], "pred": "", "answers": row["answers"], "all_classes": row["all_classes"],
                  "length": row["length"]}
        if generation is None:
            record.update(oom=True, input_tokens=len(prompt.ids))
        else:
            record.update(pred=text, input_tokens=len(prompt.ids), cost=generation.cost())
        append_record(pred_path(run.out, item.dataset), record)

    def finish(self, run: SettingRun) -> dict:
        from .score import write_scores
        scores = write_scores(run.out)
        for dataset, score in scores.items():
            print(f"{dataset}: {score}")
        return scores
