"""python -m eval.observe: observation-window hit rates (SnapKV §4, Figures 2 and 3) (Hydra app)."""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from tqdm import tqdm

import snapkv

from ..hydra_app import output_dir, resolve_device, run_guarded, save_run_metadata, task_main
from ..jsonl import append_record, read_records
from ..settings import claim, fingerprint
from .capture import Windows, hit_rate_pass, last_window_votes
from .data import load_samples
from .hits import overlap
from .summary import figures, overlap_table, tables
from snapkv.errors import InputError


def check(observe) -> None:
    for name in ("window", "prompt_windows", "response_windows", "kernel", "other_instructions"):
        value = observe[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"observe.{name}={value!r} must be an integer >= 1")
    if not 0 < float(observe.p) <= 1:
        raise InputError(f"observe.p={observe.p!r} is the kept fraction: a number in (0, 1]")
    if not 0 < float(observe.theta) < 1:
        raise InputError(f"observe.theta={observe.theta!r} is an attention threshold: a number in (0, 1)")
    if observe.kernel % 2 == 0:
        raise InputError(f"observe.kernel={observe.kernel} must be odd")


def response_ids(runner, tokenizer, sample, observe) -> list[int]:
    needed = observe.response_windows * observe.window
    if observe.response == "reference":
        return tokenizer(sample.response or "", add_special_tokens=False).input_ids
    gen = runner.generate(torch.tensor([sample.prompt_ids]), snapkv.FullKV(), needed)
    return gen.tokens


def run(cfg: DictConfig):
    from ..runner import Runner, load_model, load_tokenizer
    from ..speculation import plain_decoding_only
    plain_decoding_only(cfg, "eval.observe", "leave it none (its responses are plain greedy's)")
    observe = cfg.observe
    check(observe)
    out = output_dir(cfg)
    result_file = "hits.jsonl" if observe.variant == "hits" else "overlap.jsonl"
    claim(out, fingerprint(cfg), cfg.resume, [result_file])
    tokenizer = load_tokenizer(cfg.model)
    samples = load_samples(cfg, tokenizer)
    results = out / result_file
    done = {r["sample"] for r in read_records(results, repair=True)}
    need_prompt = max(int(observe.min_prompt_tokens), observe.prompt_windows * observe.window + 1)
    eligible = [s for s in samples if len(s.prompt_ids) >= need_prompt]
    print(f"observe: {len(samples)} samples, {len(eligible)} with prompts of >= {need_prompt} tokens", end="")
    if observe.limit:
        eligible = eligible[: int(observe.limit)]
    todo = [s for s in eligible if s.id not in done]
    print(f"; {len(todo)} to run")
    if todo:
        save_run_metadata(cfg, out, snapkv.FullKV())
        model, _ = load_model(cfg.model, resolve_device(cfg), with_tokenizer=False)
        runner = Runner(model, tokenizer)
        device = runner.device
        for sample in tqdm(todo, desc="observe", unit="sample", dynamic_ncols=True):
            if observe.variant == "instructions":
                record = instruction_overlap(model, tokenizer, sample, samples, cfg, device)
            else:
                record = hit_rate_record(model, runner, tokenizer, sample, observe, device)
            if record is not None:
                append_record(results, record)
    key = "layers" if observe.variant == "instructions" else "records"
    lines = [line for line in read_records(results) if line.get(key)]
    if not lines:
        need_response = max(int(observe.min_response_tokens), observe.response_windows * observe.window)
        raise InputError(f"observe: no sample qualified (prompt >= {need_prompt} tokens, response >= "
                         f"{need_response} tokens); lower "
                         "observe.min_prompt_tokens / min_response_tokens / window, or use other data")
    settings = (f"{cfg.model.name}, window {observe.window}, p {observe.p}, theta {observe.theta}, "
                f"pooling {observe.pooling}, question at the {observe.question_position}, response: {observe.response}")
    if observe.variant == "instructions":
        (out / "overlap.md").write_text(overlap_table(lines), encoding="utf-8")
        print((out / "overlap.md").read_text())
        return lines
    (out / "hit_rates.md").write_text(tables(lines, settings), encoding="utf-8")
    figures(lines, out, cfg.model.name)
    print(f"observe: {len(lines)} samples -> {out / 'hit_rates.md'}, figure2_prompt_windows.png, "
          "figure3_response_windows.png")
    return lines


def hit_rate_record(model, runner, tokenizer, sample, observe, device) -> dict | None:
    response = response_ids(runner, tokenizer, sample, observe)
    need = max(int(observe.min_response_tokens), observe.response_windows * observe.window)
    if len(response) < need:
        print(f"observe: sample {sample.id}: response of {len(response)} tokens < {need}; skipped")
        return {"sample": sample.id, "skipped": f"response of {len(response)} tokens < {need}", "records": []}
    w = Windows(len(sample.prompt_ids), observe.window, observe.prompt_windows, observe.response_windows)
    ids = torch.tensor([sample.prompt_ids + response[: observe.response_windows * observe.window]], device=device)
    records = hit_rate_pass(model, ids, w, float(observe.p), float(observe.theta), observe.pooling, observe.kernel)
    return {"sample": sample.id, "prompt_tokens": w.prompt_len, "response_tokens": len(response),
            "records": records}


def instruction_overlap(model, tokenizer, sample, samples, cfg, device) -> dict | None:
    """The same document with other rows' questions: overlap of the last window's selections over
    the tokens the two prompts share (the document, before the question)."""
    observe = cfg.observe
    if sample.row is None:
        raise InputError("observe.variant=instructions needs LongBench rows (observe.data=longbench:...)")
    others = [s.row["input"] for s in samples if s.id != sample.id][: observe.other_instructions]
    own = torch.tensor([sample.prompt_ids], device=device)
    result = {"sample": sample.id, "others": [], "layers": None}
    per_pair = []
    for question in others:
        variant = dict(sample.row, input=question)
        ids = _prompt_of(variant, tokenizer, cfg)
        shared = next((i for i, (a, b) in enumerate(zip(sample.prompt_ids, ids)) if a != b), min(len(ids), len(own[0])))
        prefix = min(shared, len(ids) - observe.window, own.shape[1] - observe.window)
        if prefix < 1:
            continue
        va = last_window_votes(model, own, observe.window, prefix)
        vb = last_window_votes(model, torch.tensor([ids], device=device), observe.window, prefix)
        per_pair.append([[round(float(x), 5)
                          for x in overlap(va[l], vb[l], float(observe.p), observe.pooling, observe.kernel)]
                         for l in sorted(va)])
        result["others"].append(question)
    if not per_pair:
        return None
    result["layers"] = [[sum(p[l][h] for p in per_pair) / len(per_pair) for h in range(len(per_pair[0][l]))]
                        for l in range(len(per_pair[0]))]
    return result


def _prompt_of(row, tokenizer, cfg) -> list[int]:
    from ..longbench.prompt import build_input_ids
    dataset = cfg.observe.data.split(":")[1]
    return build_input_ids(tokenizer, row, dataset, int(cfg.model.max_length), cfg.model.chat_format)


@task_main("observe")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
