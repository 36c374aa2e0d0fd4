"""The task engine: what every prediction task (LongBench, needle, lines) does alike.

A job runs one compressor setting, or a group of them that the ``shared_prefill`` sweeper gave it
(``shared_prefill.group``: a JSON file of the settings and their folders). Each setting keeps the
folder, ``settings.json``, metadata and record lines its solo run would have; the engine claims
every folder, finds the items each setting still lacks, loads the model once, and runs every item
with one prefill for all the settings that lack it (``Runner.generate_shared``), then decodes each
setting from its own cache. When the shared prefill runs out of memory, the item is retried setting
by setting, so a setting records an OOM exactly where its solo run would.

Items in flight (``batch.items``, ``eval.batching``): several pending items are prefilled (one after
another, or with ``batch.prefill=padded`` as one left-padded batch) and decoded together, every setting
of the job on each. A batch that runs out of memory is split in two and each half retried, down to one
item, which runs as above (so one item's OOM is never another's). With a padded prefill, settings whose
method cannot take one (PyramidKV, KVzip) run item by item beside the batches. Records, resume, the
lock and progress stay per item.

A task supplies only what is its own (``PredictionTask``): the fields that shape its results, its
items, how an item becomes a prompt, and how a response becomes a record.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

import snapkv
from snapkv.errors import InputError

from .batching import WINDOW, AutoSize, Entry, batch_options, cut_batches
from .hydra_app import make_compressor, resolve_device, save_run_metadata, shared_group
from .runner import Generation, free_memory, is_oom
from .settings import claim, fingerprint
from .speculation import SpeculationOptions, drafting, load_assistant, speculation_options


@dataclass
class SettingRun:
    """One compressor setting of a job: the job config with this setting's compressor node and
    folder, the compressor, and what the task keeps per setting (records so far, pending keys)."""
    cfg: object
    compressor: snapkv.Method
    pending: set = field(default_factory=set)
    state: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)


@dataclass
class Prompt:
    """One item's prompt, how to generate its answer, and what recording it needs."""
    ids: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    min_new_tokens: int = 0
    fields: dict = field(default_factory=dict)
    # the last ``question_tokens`` ids are the question part: with ``query_aware=false`` they are
    # appended uncompressed after the compressed context (see ``eval.chat.encode_chat_split``)
    question_tokens: int = 0


class PredictionTask:
    """What a prediction task says about itself; the engine does the rest (see the module doc)."""

    name = ""
    result_names: tuple = ()   # files or folders whose presence means a folder holds results
    splits_question = False    # its prompts mark their question part (``Prompt.question_tokens``)
    drafting = None            # set by the engine: speculative decoding's drafters (``Runner.drafting``), for a
                               # task running generations on a runner of its own

    def check(self, cfg) -> None:
        """Validate the task's fields (before any folder is claimed)."""

    def settings(self, cfg) -> dict:
        """Task fields that change a record (the folder's fingerprint)."""
        raise NotImplementedError

    def items(self, cfg) -> list:
        """Every item of the job, in order; each has a hashable ``key``."""
        raise NotImplementedError

    def open(self, run: SettingRun, items: list) -> set:
        """Prepare a setting's folder for resuming; return the keys of the items it still lacks."""
        raise NotImplementedError

    def prepare(self, cfg, tokenizer, pending_items: list) -> None:
        """Work that depends on the tokenizer, done once before the model loads (checks too)."""

    def metadata(self, cfg) -> dict:
        return {}

    def skip(self, run: SettingRun, item) -> bool:
        """Record an item this setting does not run (e.g. longer than a length that ran out of memory
        at every depth) and return True; False runs it."""
        return False

    def prompt(self, item, model, tokenizer) -> Prompt:
        raise NotImplementedError

    def started(self, run: SettingRun, item, prompt: Prompt) -> None:
        """Called before the item runs for this setting (e.g. a marker for a crash inside it)."""

    def record(self, run: SettingRun, item, prompt: Prompt, generation: Generation | None, text: str | None) -> None:
        """Write the item's record for this setting; ``generation`` None: it ran out of memory."""
        raise NotImplementedError

    def finish(self, run: SettingRun):
        """Summarise one setting's folder (scores, figures); returns the setting's result."""
        raise NotImplementedError


def job_settings(cfg) -> list[SettingRun]:
    """The settings this job runs: its own compressor, or those of its ``shared_prefill.group``."""
    members = shared_group(cfg)
    if not members:
        return [SettingRun(cfg, make_compressor(cfg.compressor))]
    base = OmegaConf.to_container(cfg, resolve=True)
    runs = []
    for member in members:
        one = OmegaConf.create({**base, "compressor": member["compressor"], "output_dir": member["output_dir"]})
        runs.append(SettingRun(one, make_compressor(one.compressor)))
    return runs


def run(task: PredictionTask, cfg):
    """Run a prediction task job; returns ``{folder: result}`` for a group, the result for one setting."""
    if not query_aware(cfg) and not task.splits_question:
        raise InputError(f"query_aware=false is not allowed for {task.name}: its prompts have no question part to "
                         "keep out of the compression; leave query_aware=true")
    task.check(cfg)
    runs = job_settings(cfg)
    for one in runs:
        if not query_aware(cfg) and one.compressor.needs_question_length:
            raise InputError(f"compressor.method={one.compressor.method}: its window is the question inside the "
                             "compressed prompt, which query_aware=false keeps out; use query_aware=true")
    items = task.items(cfg)
    together = decode_together(cfg)
    speculation = speculation_options(cfg)
    for one in runs:
        one.out.mkdir(parents=True, exist_ok=True)
        settings = fingerprint(one.cfg, task.settings(one.cfg))
        if together and len(runs) > 1:  # batched decoding may change a token: its records are not the exact ones
            settings["shared_prefill.decode_together"] = True
        if not query_aware(cfg):
            settings["query_aware"] = False
        settings.update(speculation.settings())  # greedy speculation writes greedy's tokens, but its costs differ
        batch = batch_options(cfg)
        if batch.batched:  # batched arithmetic may round differently: not the one-at-a-time records
            settings["batch.items"] = batch.items
            settings["batch.prefill"] = batch.prefill
        claim(one.out, settings, cfg.resume, task.result_names)
        one.pending = task.open(one, items)
    if any(one.pending for one in runs):
        work = [item for item in items if any(item.key in one.pending for one in runs)]
        execute(task, cfg, runs, work, speculation)
    else:
        print(f"{task.name}: every record is already there" + (f" ({len(runs)} settings)" if len(runs) > 1 else ""))
    results = {str(one.out): task.finish(one) for one in runs}
    return results if len(runs) > 1 else results[str(runs[0].out)]


def execute(task: PredictionTask, cfg, runs: list[SettingRun], work: list, speculation: SpeculationOptions) -> None:
    from .runner import Runner, chunking, load_model, load_tokenizer
    tokenizer = load_tokenizer(cfg.model)
    task.prepare(cfg, tokenizer, work)
    for one in runs:
        if one.pending:
            save_run_metadata(one.cfg, one.out, one.compressor, task.metadata(one.cfg))
    device = resolve_device(cfg)
    model, _ = load_model(cfg.model, device, with_tokenizer=False)
    runner = Runner(model, tokenizer, **chunking(cfg.model))
    runner.drafting = task.drafting = drafting(speculation, load_assistant(speculation, tokenizer, device))
    runner.token_progress = getattr(task, "token_progress", None)  # a task counting its answers' tokens as they come
    shared = len(runs) > 1
    progress = Progress(tqdm(total=len(work), desc=task.name + (f" x{len(runs)} settings" if shared else ""),
                             unit="item", dynamic_ncols=True))
    aware, together, batch = query_aware(cfg), decode_together(cfg), batch_options(cfg)

    def prompted(items):
        """``(item, prompt, settings that run it, question tokens)`` for each item some setting runs."""
        for item in items:
            active = active_runs(task, runs, item)
            if not active:
                progress.advance(None)
                continue
            prompt = task.prompt(item, model, tokenizer)
            yield item, prompt, active, 0 if aware else asked_after(prompt, item)

    if not batch.batched:
        for item, prompt, active, question in prompted(work):
            run_one(task, runner, item, prompt, active, together, question, progress)
        return
    size_for = (AutoSize(batch, cfg.model, [one.compressor for one in runs], device, together)
                if batch.items == "auto" else lambda length, answer: batch.items)
    window = WINDOW * batch.largest
    for start in range(0, len(work), window):
        entries = []
        for item, prompt, active, question in prompted(work[start:start + window]):
            alone = [one for one in active if batch.prefill == "padded" and not one.compressor.takes_padded_batch()]
            if alone:  # item by item beside the batches (their method takes no padded batch)
                run_one(task, runner, item, prompt, alone, together, question, progress,
                        counts=len(alone) == len(active))
            rest = [one for one in active if one not in alone]
            if rest:
                entries.append(Entry(item, prompt, rest, question))
        for entries_of_batch in cut_batches(entries, size_for):
            run_batch(task, runner, entries_of_batch, together, batch.prefill, progress)


class Progress:
    """The progress bar: items done, prompt tokens per second, OOMs."""

    def __init__(self, bar):
        self.bar, self.tokens, self.ooms, self.started = bar, 0, 0, time.perf_counter()

    def advance(self, prompt: Prompt | None, ooms: int = 0, counts: bool = True) -> None:
        self.ooms += ooms
        if counts:
            self.tokens += 0 if prompt is None else len(prompt.ids)
            self.bar.update(1)
        self.bar.set_postfix(tok_s=f"{self.tokens / (time.perf_counter() - self.started):.0f}", oom=self.ooms)


def active_runs(task: PredictionTask, runs: list[SettingRun], item) -> list[SettingRun]:
    """The settings that run ``item`` now (it leaves their pending set; a setting may skip it)."""
    active = []
    for one in runs:
        if item.key not in one.pending:
            continue
        one.pending.discard(item.key)
        if not task.skip(one, item):
            active.append(one)
    return active


def record_item(task: PredictionTask, tokenizer, item, prompt: Prompt, active: list[SettingRun],
                generations: list) -> int:
    """Each setting's record of ``item``; returns how many ran out of memory."""
    for one, gen in zip(active, generations):
        text = None if gen is None else tokenizer.decode(trim_stop(gen.tokens, prompt.stop_ids),
                                                         skip_special_tokens=True)
        task.record(one, item, prompt, gen, text)
    return sum(gen is None for gen in generations)


def run_one(task, runner, item, prompt: Prompt, active: list[SettingRun], together: bool, question: int,
            progress: Progress, counts: bool = True) -> None:
    """One item for its settings, one prefill for all of them (``counts``: the item is done after it)."""
    for one in active:
        task.started(one, item, prompt)
    generations = generate(runner, prompt, [one.compressor for one in active], together, question)
    progress.advance(prompt, record_item(task, runner.tokenizer, item, prompt, active, generations), counts)


def run_batch(task, runner, entries: list[Entry], together: bool, prefill: str, progress: Progress) -> None:
    """Items in flight: ``entries`` (one generation, question part and settings) prefilled and decoded as
    one batch; out of memory, each half again, down to one item (``run_one``)."""
    if len(entries) == 1:
        entry = entries[0]
        run_one(task, runner, entry.item, entry.prompt, entry.runs, together, entry.question, progress)
        return
    for entry in entries:
        for one in entry.runs:
            task.started(one, entry.item, entry.prompt)
    first = entries[0]
    try:
        generations = runner.generate_items(
            [e.prompt.ids for e in entries], [one.compressor for one in first.runs], first.prompt.max_new_tokens,
            stop_ids=first.prompt.stop_ids, min_new_tokens=first.prompt.min_new_tokens, together=together,
            question_tokens=first.question, prefill=prefill,
            questions_in_prompts=[0 if e.question else e.prompt.question_tokens for e in entries])
    except Exception as exc:
        if not is_oom(exc):
            raise
        generations = None  # split once the exception, and the batch's tensors its frames hold, are gone
    if generations is None:
        free_memory()
        half = len(entries) // 2
        run_batch(task, runner, entries[:half], together, prefill, progress)
        run_batch(task, runner, entries[half:], together, prefill, progress)
        return
    for entry, per_setting in zip(entries, generations):
        ooms = record_item(task, runner.tokenizer, entry.item, entry.prompt, entry.runs, per_setting)
        progress.advance(entry.prompt, ooms)


def trim_stop(tokens: list[int], stop_ids) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens


def query_aware(cfg) -> bool:
    """``query_aware`` (default true, the paper's protocol): the question is inside the compressed
    prompt; false: it is appended after the context is compressed (kvpress's query-agnostic runs)."""
    value = cfg.get("query_aware", True)
    if not isinstance(value, bool):
        raise InputError(f"query_aware={value!r} is not allowed; choose true or false")
    return value


def asked_after(prompt: Prompt, item) -> int:
    """The question tokens to append after compression (``query_aware=false``)."""
    if not 0 < prompt.question_tokens < len(prompt.ids):
        raise InputError(f"query_aware=false: item {item.key!r} has no question part to split off "
                         f"({prompt.question_tokens} of {len(prompt.ids)} tokens)")
    return prompt.question_tokens


def decode_together(cfg) -> bool:
    value = (cfg.get("shared_prefill") or {}).get("decode_together", False)
    if not isinstance(value, bool):
        raise InputError(f"shared_prefill.decode_together={value!r} is not allowed; choose true or false")
    return value


def generate(runner, prompt: Prompt, compressors: list, together: bool = False,
             question_tokens: int = 0) -> list[Generation | None]:
    """Each compressor's generation for one prompt (None: out of memory). Several compressors share
    one prefill (``together``: and decode as batches); when that runs out of memory each is retried
    alone, as its solo run would be. ``question_tokens``: the last ones are appended after compression; else
    the prompt's question part is prefilled with the rest, and its length goes to the session for a method
    reading it (``Method.needs_question_length``, FINCH's window)."""
    ids = torch.tensor([prompt.ids])
    kwargs = dict(stop_ids=prompt.stop_ids, min_new_tokens=prompt.min_new_tokens, question_tokens=question_tokens,
                  question_in_prompt=0 if question_tokens else prompt.question_tokens)
    if len(compressors) > 1:
        try:
            return runner.generate_shared(ids, compressors, prompt.max_new_tokens, together=together, **kwargs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            free_memory()
    out = []
    for compressor in compressors:
        try:
            out.append(runner.generate(ids, compressor, prompt.max_new_tokens, **kwargs))
        except Exception as exc:
            if not is_oom(exc):
                raise
            free_memory()
            out.append(None)
    return out
