"""RULER as a prediction task of the engine: the samples of ``eval.ruler.generate``, one line a
sample in ``pred/<length>/<task>.jsonl``, scored with RULER's metrics per task and length.

The prompt: with ``ruler.template`` null, the task text (RULER's ``base`` template) is the user turn
of the model config's ``chat_format`` and RULER's answer prefix follows the wrapper, as RULER puts it
after its own model templates; with a RULER template name, RULER's own text (template and answer
prefix), tokenized as RULER's ``hf`` model does (special tokens added). With ``query_aware=false``
the query (RULER's question and answer prefix) is appended after the context is compressed.

``ruler.source``: ``generate`` (default) runs RULER's generator with the model's tokenizer;
``kvpress`` reads the set kvpress's leaderboard evaluates (``eval.ruler.kvpress``: the hub's
``simonjegou/ruler`` or ``ruler.kvpress_data``) and builds each prompt as kvpress's pipeline does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..chat import encode_chat_split, split_at, stop_token_ids
from ..engine import PredictionTask, Prompt, SettingRun
from ..jsonl import append_record, read_records, rewrite_records, write_json_atomic
from . import kvpress
from .generate import MODEL_TEMPLATES, TASKS, generate, max_new_tokens, parts
from .metrics import nulls, score
from snapkv.errors import InputError

SOURCE = "hsiehjackson/RULER scripts/data/prepare.py + scripts/eval/evaluate.py (synthetic.yaml)"
SCORES_FILE = "scores.json"
SOURCES = ("generate", "kvpress")


def pred_path(run_dir: Path, length: int, task: str) -> Path:
    return Path(run_dir) / "pred" / str(length) / f"{task}.jsonl"


def _positive(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{field}={value!r} must be a positive integer")
    return value


def source_of(section) -> str:
    """``ruler.source`` (``generate`` where the section has no such key)."""
    return section.get("source") or "generate"


def check_section(section) -> None:
    tasks = list(section.tasks or [])
    if not tasks:
        raise InputError(f"ruler.tasks is empty; choose from {', '.join(TASKS)}")
    for task in tasks:
        if task not in TASKS:
            raise InputError(f"ruler.tasks: {task!r} is not allowed; choose from {', '.join(TASKS)}")
    if not list(section.lengths or []):
        raise InputError("ruler.lengths is empty; give token lengths, e.g. [4096, 8192]")
    for length in section.lengths:
        _positive(length, "ruler.lengths")
    _positive(section.samples, "ruler.samples")
    if isinstance(section.seed, bool) or not isinstance(section.seed, int):
        raise InputError(f"ruler.seed={section.seed!r} must be an integer")
    if section.template is not None and section.template not in MODEL_TEMPLATES:
        raise InputError(f"ruler.template={section.template!r} is not allowed; choose null (the model's chat_format) "
                         f"or one of {', '.join(MODEL_TEMPLATES)}")
    source = source_of(section)
    if source not in SOURCES:
        raise InputError(f"ruler.source={source!r} is not allowed; choose one of {', '.join(SOURCES)}")
    if source == "kvpress" and section.template is not None:
        raise InputError(f"ruler.template={section.template!r}: ruler.source=kvpress reads RULER's base text as "
                         "kvpress split it and wraps it with the model's chat_format; leave ruler.template=null")
    if source != "kvpress" and section.get("kvpress_data") is not None:
        raise InputError(f"ruler.kvpress_data={section.kvpress_data}: read only with ruler.source=kvpress "
                         "(generating needs no data file)")


def sources(section) -> dict:
    return dict(essays=section.get("essays"), squad=section.get("squad"), hotpotqa=section.get("hotpotqa"),
                punkt=section.get("punkt"))


def kvpress_rows(section, task: str, length: int) -> list[dict]:
    """kvpress's rows of a task at a length (``ruler.source=kvpress``)."""
    rows, _ = kvpress.load(section.get("kvpress_data"), int(length), len(section.lengths))
    if task not in rows:
        raise InputError(f"ruler.tasks: {task} has no rows in kvpress's data "
                         f"({kvpress.data_source(section.get('kvpress_data'))} at {length}; it has "
                         f"{', '.join(sorted(rows)) or 'none'})")
    return rows[task]


def samples_of(section, tokenizer, task: str, length: int, count: int) -> list[dict]:
    if source_of(section) == "kvpress":
        return kvpress_rows(section, task, length)[:count]
    return generate(task, int(length), count, tokenizer, seed=int(section.seed), template=section.template or "base",
                    **sources(section))


def export(section, tokenizer, directory: str) -> list[Path]:
    """``ruler.export=DIR``: the samples in RULER's layout, ``DIR/<length>/<task>/validation.jsonl``."""
    from .generate import export as write_rows
    return [write_rows(Path(directory) / str(length), task,
                       samples_of(section, tokenizer, task, length, int(section.samples)))
            for length in section.lengths for task in section.tasks]


@dataclass
class Sample:
    task: str
    length: int
    index: int

    @property
    def key(self):
        return self.length, self.task, self.index


class RulerTask(PredictionTask):
    """RULER's synthetic tasks at the configured lengths, ``samples`` each."""

    name = "ruler"
    result_names = ("pred",)
    splits_question = True

    def check(self, cfg) -> None:
        check_section(cfg.ruler)
        self.section, self.model_cfg = cfg.ruler, cfg.model

    def settings(self, cfg) -> dict:
        """Generating is what folders made before ``ruler.source`` recorded, so it records nothing new
        (None equals an absent field); kvpress's data records its source, and drops the generator's
        inputs, which it does not read."""
        section = cfg.ruler
        if source_of(section) != "kvpress":
            return {"ruler.source": None, "ruler.kvpress_data": None}
        _, data = kvpress.load(section.get("kvpress_data"), int(section.lengths[0]), len(section.lengths))
        unused = {f"ruler.{name}": None for name in ("seed", "essays", "punkt", "squad", "hotpotqa")}
        return {**unused, "ruler.source": "kvpress", "ruler.kvpress_data": data}

    def count(self, task: str, length) -> int:
        """Samples run of a task at a length: ``ruler.samples``, or fewer where kvpress's data has fewer."""
        samples = int(self.section.samples)
        if source_of(self.section) != "kvpress":
            return samples
        available = len(kvpress_rows(self.section, task, int(length)))
        told = self.__dict__.setdefault("_told", set())
        if available < samples and (task, int(length)) not in told:
            told.add((task, int(length)))
            print(f"ruler: kvpress's data has {available} samples of {task} at {length}; running those "
                  f"(ruler.samples={samples})")
        return min(samples, available)

    def items(self, cfg) -> list[Sample]:
        s = self.section
        return [Sample(task, int(length), i) for length in s.lengths for task in s.tasks
                for i in range(self.count(task, length))]

    def open(self, run: SettingRun, items) -> set:
        pending = set()
        for length in self.section.lengths:
            for task in self.section.tasks:
                path = pred_path(run.out, length, task)
                records = read_records(path, repair=True)
                if self.section.retry_oom and any(r.get("oom") for r in records):
                    records = [r for r in records if not r.get("oom")]
                    rewrite_records(path, records)
                done = {r["index"] for r in records}
                pending |= {(int(length), task, i) for i in range(self.count(task, length)) if i not in done}
        return pending

    def metadata(self, cfg) -> dict:
        if source_of(cfg.ruler) == "kvpress":
            return {"protocol_source": kvpress.SOURCE,
                    "template": f"kvpress's pipeline, chat_format {cfg.model.chat_format}"}
        return {"protocol_source": SOURCE, "template": cfg.ruler.template or f"chat_format {cfg.model.chat_format}"}

    def prepare(self, cfg, tokenizer, pending_items: list) -> None:
        """Generate each (task, length)'s samples once, up to the last one still pending (sample ``i``
        does not depend on how many are drawn: RULER's draws run in index order)."""
        needed: dict = {}
        for item in pending_items:
            needed[(item.task, item.length)] = max(needed.get((item.task, item.length), 0), item.index + 1)
        self.rows = {key: samples_of(self.section, tokenizer, *key, count) for key, count in needed.items()}

    def prompt(self, item: Sample, model, tokenizer) -> Prompt:
        row = self.rows[(item.task, item.length)][item.index]
        kvpress_row = source_of(self.section) == "kvpress"
        built = kvpress.encode(tokenizer, row, self.model_cfg.chat_format) if kvpress_row else None
        if built is not None:  # kvpress's data, wrapped as kvpress's pipeline wraps it
            ids, question = built
        elif self.section.template is not None:  # RULER's own text; its hf model adds special tokens
            ids, question = split_at(tokenizer, row["input"], True, row["query_at"])
        else:
            context, query, prefix = parts(row)
            ids, question = encode_chat_split(tokenizer, context + query, self.model_cfg.chat_format, len(context),
                                              suffix=prefix)
        if not hasattr(self, "stops"):
            self.stops = stop_token_ids(model, tokenizer)
        return Prompt(ids, row.get("max_new_tokens") or max_new_tokens(item.task), self.stops,
                      fields={"outputs": row["outputs"], "ruler_length": row["length"]}, question_tokens=question)

    def record(self, run: SettingRun, item: Sample, prompt: Prompt, generation, text) -> None:
        record = {"index": item.index, "pred": text, "outputs": prompt.fields["outputs"],
                  "length": prompt.fields["ruler_length"], "input_tokens": len(prompt.ids)}
        if generation is None:
            record.update(pred=None, oom=True)
        else:
            record["cost"] = generation.cost()
        append_record(pred_path(run.out, item.length, item.task), record)

    def finish(self, run: SettingRun) -> dict:
        scores = write_scores(run.out, [int(n) for n in self.section.lengths], list(self.section.tasks))
        print(table(scores))
        return scores


def write_scores(run_dir: Path, lengths: list[int], tasks: list[str]) -> dict:
    """``scores.json``: per length, each task's RULER score (OOM samples left out, counted) and the
    average over the tasks (``complete`` when all 13 are there, as the RULER paper's table averages)."""
    out: dict = {}
    for length in lengths:
        per_task, counts = {}, {}
        for task in tasks:
            records = read_records(pred_path(run_dir, length, task))
            ran = [r for r in records if not r.get("oom")]
            counts[task] = {"samples": len(records), "oom": len(records) - len(ran),
                            "nulls": nulls([r["pred"] for r in ran]) if ran else "0/0"}
            if ran:
                per_task[task] = score(task, [r["pred"] for r in ran], [r["outputs"] for r in ran])
        average = round(sum(per_task.values()) / len(per_task), 2) if per_task else None
        out[str(length)] = {"tasks": per_task, "average": average,
                            "complete": sorted(per_task) == sorted(TASKS), "counts": counts}
    write_json_atomic(Path(run_dir) / SCORES_FILE, out)
    return out


def table(scores: dict) -> str:
    """Tasks as rows, lengths as columns, the average last (the RULER paper's layout, transposed per task)."""
    lengths = list(scores)
    tasks = [t for t in TASKS if any(t in scores[n]["tasks"] for n in lengths)]
    lines = ["| task | " + " | ".join(lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for task in tasks:
        cells = [scores[n]["tasks"].get(task) for n in lengths]
        lines.append(f"| {task} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    avg = [scores[n]["average"] for n in lengths]
    marks = ["" if scores[n]["complete"] else f" ({len(scores[n]['tasks'])}/13 tasks)" for n in lengths]
    lines.append("| average | " + " | ".join("–" if a is None else f"{a:.2f}{m}" for a, m in zip(avg, marks)) + " |")
    return "\n".join(lines)
