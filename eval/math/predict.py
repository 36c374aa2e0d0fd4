"""AIME25 and MATH-500 as a prediction task of the engine: one line a problem in ``pred/<dataset>.jsonl``.

A job runs one dataset (``math.dataset``) into its own folder
(``results/runs/math/<dataset>/<model>/<setting>``). Each row becomes a prompt as kvpress's pipeline builds
it (``eval.math.prompt``) and is answered greedily up to its own ``max_new_tokens`` (``math.max_new_tokens``
overrides it, as kvpress's ``--max_new_tokens`` does), stopping at the model's end-of-sequence ids. The
record keeps kvpress's column name for the answer (``predicted_answer``), both scorers' verdicts and what
the generation cost; ``finish`` scores the folder again from the predictions (``eval.math.score``).
"""
from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from ..chat import stop_token_ids
from ..engine import PredictionTask, Prompt, SettingRun
from ..jsonl import append_record, read_records, rewrite_records, write_json_atomic
from . import data, score
from .prompt import encode
from snapkv.errors import InputError

SOURCE = ("NVIDIA/kvpress evaluation/evaluate.py (datasets aime25, math500), kvpress/pipeline.py, "
          "evaluation/benchmarks/{aime25,math500}/calculate_metrics.py")
DATASET_FILE = "dataset.json"
# fields of a row that the record does not copy (the prompt's parts and the answer are written as such)
_PROMPT_COLUMNS = ("context", "answer_prefix", "max_new_tokens")


def check_section(section) -> None:
    if section.get("dataset") not in data.DATASETS:
        raise InputError(f"math.dataset={section.get('dataset')!r} is not allowed; choose one of "
                         f"{', '.join(data.DATASETS)}")
    for name in ("limit", "max_new_tokens"):
        value = section.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"math.{name}={value!r} must be a positive integer (or null)")
    if section.get("data") is None and not section.get("revision"):
        raise InputError("math.revision must name a revision of the hub dataset (a commit, tag or branch) "
                         "when math.data is null")
    thinking = section.get("enable_thinking")
    if not isinstance(thinking, bool):
        raise InputError(f"math.enable_thinking={thinking!r} is not allowed; choose true or false")


def chat_format(cfg) -> str:
    """``math.chat_format``, or the model's when null."""
    return cfg.math.get("chat_format") or cfg.model.chat_format


@dataclass
class Problem:
    index: int
    row: dict

    @property
    def key(self):
        return self.index


class MathTask(PredictionTask):
    """The rows of ``math.dataset`` (or the first ``limit``), kvpress's prompts and scorers."""

    name = "math"
    result_names = ("pred",)
    splits_question = True  # the pipeline's question part (question + template tail + answer prefix)

    def check(self, cfg) -> None:
        check_section(cfg.math)
        self.section, self.dataset = cfg.math, str(cfg.math.dataset)
        self.chat_format = chat_format(cfg)
        data_path = self.section.get("data")
        self.rows, self.info = data.load(self.dataset, None if data_path is None else str(data_path),
                                         str(self.section.get("revision") or "main"))
        self.bar = None

    def settings(self, cfg) -> dict:
        """The data's source and digest stand for ``data`` and ``revision``; ``chat_format`` resolved."""
        return {"math.data_source": self.info["source"], "math.data_sha256": self.info["sha256"],
                "math.chat_format": self.chat_format}

    def items(self, cfg) -> list[Problem]:
        rows = self.rows[:self.section.limit] if self.section.limit else self.rows
        return [Problem(i, row) for i, row in enumerate(rows)]

    def open(self, run: SettingRun, items) -> set:
        write_json_atomic(run.out / DATASET_FILE, self.info)
        path = score.pred_path(run.out, self.dataset)
        records = read_records(path, repair=True)
        if self.section.retry_oom and any(r.get("oom") for r in records):
            records = [r for r in records if not r.get("oom")]
            rewrite_records(path, records)
        done = {r.get("index") for r in records}
        return {item.key for item in items if item.key not in done}

    def metadata(self, cfg) -> dict:
        return {"protocol_source": SOURCE, "dataset": data.HUB[self.dataset], "data_revision": self.info["revision"],
                "template": f"kvpress's pipeline, chat_format {self.chat_format}"
                            + (", thinking enabled" if self.section.enable_thinking else "")}

    def max_new_tokens(self, row: dict) -> int:
        return self.section.get("max_new_tokens") or row["max_new_tokens"]

    def prompt(self, item: Problem, model, tokenizer) -> Prompt:
        if self.bar is None:
            self.stops = stop_token_ids(model, tokenizer)
            # the engine's bar counts items; this one the answers' tokens, step by step (token_progress)
            self.bar = tqdm(desc=f"{self.name} {self.dataset} generated", unit="tok", unit_scale=True,
                            position=1, dynamic_ncols=True)
        row = item.row
        ids, question = encode(tokenizer, row["context"], row["question"], row["answer_prefix"], self.chat_format,
                               bool(self.section.enable_thinking))
        return Prompt(ids, self.max_new_tokens(row), self.stops, question_tokens=question)

    def token_progress(self, tokens: int) -> None:
        """After each decoding step: the tokens it added to the answers being written (``Runner.token_progress``)."""
        if self.bar is not None:
            self.bar.update(tokens)

    def record(self, run: SettingRun, item: Problem, prompt: Prompt, generation, text) -> None:
        row = item.row
        record = {"index": item.index, "question": row["question"], "answer": row["answer"],
                  **{k: v for k, v in row.items() if k not in (*_PROMPT_COLUMNS, "question", "answer")}}
        record.update(input_tokens=len(prompt.ids), max_new_tokens=prompt.max_new_tokens)
        if generation is None:
            record.update(predicted_answer=None, oom=True)
        else:
            tokens = generation.tokens
            record.update(predicted_answer=text, output_tokens=len(tokens),
                          hit_max_new_tokens=len(tokens) >= prompt.max_new_tokens
                          and not (tokens and tokens[-1] in prompt.stop_ids),
                          kvpress_answer=score.kvpress_answer(self.dataset, text),
                          kvpress_correct=score.kvpress_correct(self.dataset, text, row["answer"]),
                          answered=score.answered(text),
                          math_verify=score.math_verify_correct(text, row["answer"]),
                          cost=generation.cost())
        append_record(score.pred_path(run.out, self.dataset), record)

    def finish(self, run: SettingRun) -> dict:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        scores = score.write_scores(run.out, self.dataset, self.info["rows"])
        print(score.table([scores]))
        return scores

