"""LongBench v2 as a prediction task of the engine: one line a question, resumable.

Predictions go to ``pred/0shot.jsonl`` (or ``pred/0shot_cot.jsonl`` with ``cot=true``, named after
the first pass's template), each line the fields official ``pred.py`` writes, in its order, then
ours (``input_tokens``, ``truncated``, ``oom``). With ``cot=true`` each question takes two passes,
as in pred.py: the chain of thought from ``0shot_cot.txt``, then the answer from
``0shot_cot_ans.txt`` with that response inserted; the engine runs the first, ``record`` the
second (with the setting's own compressor, on the same model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import engine
from ..chat import stop_token_ids
from ..engine import PredictionTask, Prompt, SettingRun
from ..jsonl import append_record, write_json_atomic
from ..longbench.predict import pending_rows
from .data import FIELDS, data_path, data_source, file_digest, read_rows
from .extract import extract_answer
from .prompt import ANSWER_TOKENS, COT, COT_ANSWER, COT_TOKENS, OFFICIAL_MAX_LEN, ZERO_SHOT, build
from snapkv.errors import InputError

DATASET_FILE = "dataset.json"
SOURCE = "THUDM/LongBench pred.py (LongBench v2)"


def pred_path(run_dir: Path, cot: bool) -> Path:
    return Path(run_dir) / "pred" / f"{COT if cot else ZERO_SHOT}.jsonl"


def check_task(section) -> None:
    for name in ("limit", "max_length", "max_new_tokens", "cot_max_new_tokens"):
        value = section.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"longbench_v2.{name}={value!r} must be a positive integer (or null)")
    if not section.get("data_file") and not section.get("revision"):
        raise InputError("longbench_v2.revision must name a revision of the hub dataset (a commit, tag or branch) "
                         "when longbench_v2.data_file is null")


def max_length(cfg) -> int:
    """Prompt tokens kept by middle truncation: ``longbench_v2.max_length`` (pred.py's 120000 by
    default), at most the model's ``max_length``."""
    own, model = cfg.longbench_v2.get("max_length"), cfg.model.get("max_length")
    if model is None and own is None:
        raise InputError("longbench_v2.max_length is null and the model config has no max_length; set one")
    return min(v for v in (own, model) if v is not None)


def task_settings(cfg) -> dict:
    """What the fingerprint records for ``data_file`` and ``revision``."""
    section = cfg.longbench_v2
    return {"longbench_v2.data_source": data_source(section.get("data_file"), str(section.get("revision")))}


def record_dataset(out: Path, info: dict) -> None:
    """The data file's digest and row count; data that changed under existing predictions is refused."""
    path = out / DATASET_FILE
    old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if old and old["sha256"] != info["sha256"] and any(pred_path(out, cot).exists() for cot in (False, True)):
        raise InputError(f"longbench_v2.data_file: the data changed under existing predictions in {out} "
                         f"(sha256 {old['sha256']} -> {info['sha256']}); pass resume=restart or another output_dir")
    write_json_atomic(path, info)


@dataclass
class Question:
    row: dict

    @property
    def key(self):
        return self.row["_id"]


class LongBenchV2Task(PredictionTask):
    """The 503 questions (or the first ``limit``); pred.py's prompts, truncation and extraction."""

    name = "longbench_v2"
    result_names = ("pred",)
    splits_question = True  # Prompt.question_tokens: the template's text after the document

    def check(self, cfg) -> None:
        section = cfg.longbench_v2
        check_task(section)
        self.section, self.model_cfg = section, cfg.model
        self.cot = bool(section.cot)
        self.max_len = max_length(cfg)
        self.answer_tokens = section.get("max_new_tokens") or ANSWER_TOKENS
        self.cot_tokens = section.get("cot_max_new_tokens") or COT_TOKENS
        self.path = data_path(section.get("data_file"), str(section.get("revision")))
        self.query_aware = engine.query_aware(cfg)
        self.runner = None

    def settings(self, cfg) -> dict:
        return task_settings(cfg)

    def items(self, cfg) -> list[Question]:
        rows = read_rows(self.path)
        self.info = {"file": str(self.path), "sha256": file_digest(self.path), "rows": len(rows)}
        self.rows = rows[:self.section.limit] if self.section.limit else rows
        return [Question(row) for row in self.rows]

    def open(self, run: SettingRun, items) -> set:
        record_dataset(run.out, self.info)
        path = pred_path(run.out, self.cot)
        return {r["_id"] for r in pending_rows(self.rows, path, bool(self.section.retry_oom))}

    def metadata(self, cfg) -> dict:
        return {"protocol": SOURCE, "template": COT if self.cot else ZERO_SHOT, "max_length": self.max_len,
                "official_max_length": OFFICIAL_MAX_LEN}

    def _setup(self, model, tokenizer) -> None:
        from ..runner import Runner, chunking
        self.runner = Runner(model, tokenizer, **chunking(self.model_cfg))
        self.runner.drafting = self.drafting  # the engine's speculative decoding, for the answer pass too
        self.tokenizer, self.stops = tokenizer, stop_token_ids(model, tokenizer)

    def prompt(self, item: Question, model, tokenizer) -> Prompt:
        if self.runner is None:
            self._setup(model, tokenizer)
        template = COT if self.cot else ZERO_SHOT
        ids, question_tokens, truncated = build(tokenizer, item.row, template, self.max_len,
                                                self.model_cfg.chat_format)
        return Prompt(ids, self.cot_tokens if self.cot else self.answer_tokens, self.stops,
                      fields={"truncated": truncated}, question_tokens=question_tokens)

    def _answer_pass(self, run: SettingRun, row: dict, cot: str) -> tuple[Prompt, str | None]:
        """pred.py's second pass with cot: 0shot_cot_ans.txt with the chain of thought inserted
        (with ``query_aware=false`` its question part, the chain of thought included, is appended after
        compression, as the engine does for the first pass)."""
        ids, question_tokens, truncated = build(self.tokenizer, row, COT_ANSWER, self.max_len,
                                                self.model_cfg.chat_format, cot=cot)
        prompt = Prompt(ids, self.answer_tokens, self.stops, fields={"truncated": truncated},
                        question_tokens=question_tokens)
        question = 0 if self.query_aware else engine.asked_after(prompt, Question(row))
        [generation] = engine.generate(self.runner, prompt, [run.compressor], question_tokens=question)
        if generation is None:
            return prompt, None
        return prompt, self.tokenizer.decode(engine.trim_stop(generation.tokens, self.stops), skip_special_tokens=True)

    def record(self, run: SettingRun, item: Question, prompt: Prompt, generation, text) -> None:
        row = item.row
        record = {name: row[name] for name in FIELDS}
        record["context"] = row["context"][:1000]  # as pred.py writes it
        ours = {"input_tokens": len(prompt.ids), "truncated": prompt.fields["truncated"]}
        if generation is not None and self.cot:
            record["response_cot"] = text.strip()
            answer_prompt, text = self._answer_pass(run, row, record["response_cot"])
            ours["answer_input_tokens"] = len(answer_prompt.ids)
        if generation is None or text is None:  # out of memory (in the answer pass: oom_pass)
            record.update(response="", pred=None, judge=False)
            ours.update(oom=True, **({"oom_pass": "answer"} if generation is not None else {}))
        else:
            response = text.strip()
            record.update(response=response, pred=extract_answer(response))
            record["judge"] = record["pred"] == row["answer"]
        if generation is not None:
            ours["cost"] = generation.cost()
        append_record(pred_path(run.out, self.cot), {**record, **ours})

    def finish(self, run: SettingRun) -> dict:
        from .score import table, write_scores
        scores = write_scores(run.out)
        print(table(scores))
        return scores
