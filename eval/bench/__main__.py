"""python -m eval.bench: decode speed, prefill time and memory, full KV vs compressed (Hydra app)."""
from __future__ import annotations


import torch

from snapkv.errors import InputError, check_int

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import snapkv
from snapkv.memory import longest_fitting, plan

from ..hydra_app import compressor_fields, output_dir, resolve_device, run_guarded, task_main
from ..jsonl import append_record, read_records, write_json_atomic
from ..settings import claim, fingerprint
from ..runner import chunking, model_architecture
from .tables import figure, head_adaptive_markdown, markdown


def specs_of(cfg) -> list[dict]:
    bench_cfg = cfg.bench
    methods = list(dict.fromkeys(["full", *bench_cfg.methods]))
    for m in methods:
        if m not in snapkv.METHODS:
            raise InputError(f"bench.methods: {m!r} is not a method; allowed: {', '.join(sorted(snapkv.METHODS))}")
    node = compressor_fields(cfg.compressor)
    specs = []
    for batch in bench_cfg.batch_sizes:
        specs.append(dict(method="empty_cache", run_method="full", budget=None, input_tokens=1, batch=batch))
        for length in bench_cfg.lengths:
            for method in methods:  # a method whose size is no token budget (ThinK, DuoAttention) runs once
                sized = method != "full" and "budget" not in snapkv.METHODS[method].derived
                for budget in (bench_cfg.budgets if sized else [None]):
                    specs.append(dict(method=method, budget=budget, input_tokens=int(length), batch=int(batch)))
    question = bench_cfg.question_tokens
    check_int("bench.question_tokens", question, 0)
    reads_question = any(snapkv.METHODS[m].needs_question_length for m in methods)
    if reads_question and question >= min(int(length) for length in bench_cfg.lengths):
        raise InputError(f"bench.question_tokens={question}: allowed 0 up to the shortest of bench.lengths, "
                         "exclusive")
    for s in specs:
        s.update(decode_tokens=int(bench_cfg.decode_tokens), repeats=int(bench_cfg.repeats),
                 prefill_repeats=bench_cfg.get("prefill_repeats"), question_tokens=question)
        method = s.setdefault("run_method", s["method"])
        fields = {} if method == "full" else {**node, "budget": s["budget"]}
        snapkv.build_config(method, **fields)  # validate every configuration before measuring any
        s["compressor"] = fields
    return specs


def _key(row) -> tuple:
    return row["method"], row.get("budget"), row["input_tokens"], row.get("batch", 1)


def _run_fresh(worker, spec: dict, timed) -> dict:
    """One configuration on CPU: its peak from the worker process under the fixed allocator setting
    (one run, ``eval.bench.measure.PeakWorker``), its timings from ``timed(spec)`` in this process, as
    users run Python."""
    from .measure import PEAK_FIELDS
    memory = worker.measure({**spec, "repeats": 1, "warmup": False})
    if memory is None:  # killed by the system (e.g. the host's OOM killer): not a CUDA OOM
        return {**{k: spec[k] for k in ("method", "budget", "input_tokens", "batch")}, "prefill_s": None,
                "decode_s_per_token": None, "peak_memory_bytes": None, "kv_cache_bytes": None, "oom": False,
                "killed": True}
    if memory["oom"]:
        return memory
    timing = timed(spec)
    if timing["oom"]:
        return timing
    return {**{k: v for k, v in timing.items() if k not in PEAK_FIELDS},
            **{k: memory[k] for k in PEAK_FIELDS if k in memory}}


def print_plan(cfg) -> list[dict]:
    bench_cfg, arch = cfg.bench, model_architecture(cfg.model)
    compressor = _compressor_for_plan(cfg)
    kwargs = dict(dtype=cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16",
                  attn_implementation=cfg.model.get("attn_implementation", "sdpa"),
                  **chunking(cfg.model))
    budget = int(float(bench_cfg.memory_gib) * 2**30)
    rows = []
    for name, comp in (("full", None), (compressor.method, compressor)):
        for length in bench_cfg.plan_lengths:
            p = plan(arch, int(length), comp, **kwargs)
            rows.append({"method": name, "input_tokens": int(length), **p, "fits": p["peak_bytes"] <= budget})
        rows.append({"method": name, "longest_fitting_tokens": longest_fitting(arch, budget, comp, **kwargs)})
    print(f"memory plan: {cfg.model.name}, {kwargs}, {bench_cfg.memory_gib} GiB")
    for r in rows:
        if "longest_fitting_tokens" in r:
            print(f"  {r['method']:>10}: longest input that fits = {r['longest_fitting_tokens']} tokens")
        else:
            print(f"  {r['method']:>10} {r['input_tokens']:>8} tokens: peak {r['peak_bytes'] / 2**30:7.2f} GiB "
                  f"(KV {r['kv_cache_bytes'] / 2**30:.2f}) {'fits' if r['fits'] else 'OOM'}")
    return rows


def _compressor_for_plan(cfg):
    from ..hydra_app import make_compressor
    comp = make_compressor(cfg.compressor)
    if not comp.compresses:
        comp = snapkv.SnapKV(budget=int(cfg.bench.budgets[0]))
    return comp


def _text_runner(cfg):
    """``cfg.model`` with its tokenizer as a Runner, and the model's stop tokens."""
    from ..chat import stop_token_ids
    from ..runner import Runner, load_model, load_tokenizer
    tokenizer = load_tokenizer(cfg.model)
    model, _ = load_model(cfg.model, resolve_device(cfg), with_tokenizer=False)
    return Runner(model, tokenizer, **chunking(cfg.model)), stop_token_ids(model, tokenizer)


def _settings_of(node) -> list:
    """``node.settings`` (a preset name or a list) with budgets scaled by ``node.budget_scale``."""
    from .sweep import scaled, settings_of
    spec = node.settings if isinstance(node.settings, str) else OmegaConf.to_container(node.settings, resolve=True)
    return scaled(settings_of(spec), float(node.budget_scale))


def run_sweep(cfg: DictConfig) -> dict:
    """``bench.sweep.enabled``: solo runs of each setting against one shared prefill (``eval.bench.sweep``)."""
    import torch

    from ..hydra_app import make_compressor, save_run_metadata
    from ..longbench.data import check_dataset, dataset_file, read_dataset
    from ..longbench.prompt import build_split_ids, extra_stop_ids, generation_length, min_new_tokens
    from .sweep import markdown as sweep_markdown, measure_sweep
    sw = cfg.bench.sweep
    settings = _settings_of(sw)
    dataset = check_dataset(sw.dataset)
    rows = read_dataset(dataset_file(dataset, sw.data_dir, "main"))[: int(sw.rows)]
    out = output_dir(cfg)
    save_run_metadata(cfg, out, make_compressor(cfg.compressor), {"bench.sweep": OmegaConf.to_container(sw)})
    runner, model_stops = _text_runner(cfg)
    tokenizer = runner.tokenizer
    stops = model_stops + extra_stop_ids(tokenizer, dataset)
    n_new = generation_length(dataset, sw.max_new_tokens)
    prompts = []
    for row in rows:  # the ids build_input_ids gives, and how many of the last are the question
        ids, question = build_split_ids(tokenizer, row, dataset, int(cfg.model.max_length), cfg.model.chat_format)
        prompts.append((torch.tensor([ids]), n_new, stops, min_new_tokens(dataset, cfg.model.protocol), question))
    result = measure_sweep(runner, prompts, settings, together=bool(sw.get("decode_together", True)))
    result.update(model=cfg.model.name, device=str(runner.device), dataset=dataset)
    write_json_atomic(out / "sweep.json", result)
    title = f"Shared prefill: {cfg.model.name} on {runner.device}, {dataset}"
    (out / "sweep.md").write_text(sweep_markdown(result, title), encoding="utf-8")
    print((out / "sweep.md").read_text())
    return result


def run_items(cfg: DictConfig) -> dict:
    """``bench.batching.enabled``: LongBench items one at a time against items in flight (``eval.bench.items``)."""
    from ..batching import batch_options
    from ..engine import Prompt
    from ..hydra_app import make_compressor, save_run_metadata
    from ..longbench.data import dataset_file, read_dataset
    from ..longbench.prompt import build_input_ids, extra_stop_ids, generation_length, min_new_tokens
    from .items import item_rows, markdown as items_markdown, measure_items
    node = cfg.bench.batching
    options = batch_options({"batch": {"items": node.batch, "prefill": node.prefill, "memory_gib": node.memory_gib,
                                       "max_items": node.max_items}})
    settings = _settings_of(node)
    alone = [cfg.label() for cfg in settings if not cfg.takes_padded_batch()]
    if options.prefill == "padded" and alone:
        raise InputError(f"bench.batching.prefill=padded: {', '.join(alone)} take no padded batch (per-layer "
                         "budgets, a replay, or a ratio of the padded width); use bench.batching.prefill=each")
    for name in ("short", "long"):
        if isinstance(node[name], bool) or not isinstance(node[name], int) or node[name] < 0:
            raise InputError(f"bench.batching.{name}={node[name]!r} must be a whole number of rows, 0 or more")
    sample = read_dataset(dataset_file("multi_news", node.data_dir, "main"))
    out = output_dir(cfg)
    save_run_metadata(cfg, out, make_compressor(cfg.compressor), {"bench.batching": OmegaConf.to_container(node)})
    runner, stops = _text_runner(cfg)
    tokenizer = runner.tokenizer
    prompts = [Prompt(build_input_ids(tokenizer, row, dataset, int(cfg.model.max_length), cfg.model.chat_format),
                      generation_length(dataset, None), stops + extra_stop_ids(tokenizer, dataset),
                      min_new_tokens(dataset, cfg.model.protocol))
               for dataset, row in item_rows(sample, int(node.short), int(node.long))]
    result = measure_items(runner, prompts, settings, options, cfg.model)
    result.update(model=cfg.model.name, device=str(runner.device))
    write_json_atomic(out / "items.json", result)
    title = f"Items in flight: {cfg.model.name} on {runner.device}"
    (out / "items.md").write_text(items_markdown(result, title), encoding="utf-8")
    print((out / "items.md").read_text())
    return result


def run_long_generation(cfg: DictConfig) -> dict:
    """``bench.long_generation.enabled``: full cache against cuts while decoding (``eval.bench.long_generation``)."""
    from ..hydra_app import make_compressor, save_run_metadata
    from ..runner import load_model
    from .long_generation import markdown as long_markdown, measure_long_generation, settings_of
    node = cfg.bench.long_generation
    settings_of(node)  # every setting valid before the model loads
    out = output_dir(cfg)
    save_run_metadata(cfg, out, make_compressor(cfg.compressor),
                      {"bench.long_generation": OmegaConf.to_container(node)})
    model, _ = load_model(cfg.model, resolve_device(cfg), with_tokenizer=False)
    result = measure_long_generation(model, node, str(cfg.model.get("dtype") or "float32"))
    result.update(model=cfg.model.name, device=str(next(model.parameters()).device))
    write_json_atomic(out / "long_generation.json", result)
    title = f"Long generation: {cfg.model.name} on {result['device']}"
    (out / "long_generation.md").write_text(long_markdown(result, title), encoding="utf-8")
    print((out / "long_generation.md").read_text())
    return result


def run_prefill_memory(cfg: DictConfig) -> dict:
    """``bench.prefill_memory.enabled``: bytes per prompt token against the floor, the planner, the prefill's time
    chunked against one pass, the longest input planned per memory size (``eval.bench.prefill_memory``)."""
    from ..hydra_app import make_compressor, save_run_metadata
    from ..runner import load_model
    from . import prefill_memory as pm
    node = cfg.bench.prefill_memory
    if len(node.lengths) != 2 or int(node.lengths[0]) >= int(node.lengths[1]):
        raise InputError(f"bench.prefill_memory.lengths={list(node.lengths)}: give two lengths, shorter first")
    out = output_dir(cfg)
    save_run_metadata(cfg, out, make_compressor(cfg.compressor), {"bench.prefill_memory": OmegaConf.to_container(node)})
    device = resolve_device(cfg)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    result = {"model": cfg.model.name, "dtype": str(cfg.model.dtype), "device": device,
              "attn_implementation": str(cfg.model.get("attn_implementation") or "sdpa")}
    if node.measure_memory:
        result["memory"] = pm.memory_rows(model_cfg, model_architecture(cfg.model), node, device)
    if node.time_lengths:
        model, _ = load_model(cfg.model, device, with_tokenizer=False)
        result["time"] = pm.time_rows(model, node, chunking(cfg.model)["prefill_chunk"])
        del model
    if node.plan_model:
        result["plan"] = pm.plan_rows(node)
    write_json_atomic(out / "prefill_memory.json", result)
    (out / "prefill_memory.md").write_text(pm.markdown(result), encoding="utf-8")
    print((out / "prefill_memory.md").read_text())
    return result


def run_speculative(cfg: DictConfig) -> dict:
    """``bench.speculative.enabled``: greedy against prompt-lookup and assisted decoding over full and compressed
    caches (``eval.bench.speculative``)."""
    from ..hydra_app import make_compressor, save_run_metadata
    from ..runner import load_model, model_config
    from . import speculative as sp
    node = cfg.bench.speculative
    sp.settings_of(node)  # every setting valid before the model loads
    draft_cfg = model_config(node.draft_model, "bench.speculative.draft_model") if node.draft_model else None
    out = output_dir(cfg)
    save_run_metadata(cfg, out, make_compressor(cfg.compressor), {"bench.speculative": OmegaConf.to_container(node)})
    device = resolve_device(cfg)
    model, tokenizer = load_model(cfg.model, device)
    draft = None if draft_cfg is None else load_model(draft_cfg, device, with_tokenizer=False)[0]
    result = sp.measure_speculative(model, sp.prompts(tokenizer, node, torch.device(device)), node, draft)
    result.update(model=cfg.model.name, draft_model=node.draft_model, device=str(device))
    write_json_atomic(out / "speculative.json", result)
    title = f"Speculative decoding over compressed caches: {cfg.model.name} on {device}"
    (out / "speculative.md").write_text(sp.markdown(result, title), encoding="utf-8")
    print((out / "speculative.md").read_text())
    return result


def run(cfg: DictConfig):
    from ..hydra_app import make_compressor, save_run_metadata
    from ..speculation import plain_decoding_only
    plain_decoding_only(cfg, "eval.bench times plain decoding",
                        "its speculative section is bench.speculative.enabled=true")
    if cfg.bench.get("speculative") is not None and cfg.bench.speculative.enabled:
        return run_speculative(cfg)
    if cfg.bench.get("prefill_memory") is not None and cfg.bench.prefill_memory.enabled:
        return run_prefill_memory(cfg)
    if cfg.bench.get("sweep") is not None and cfg.bench.sweep.enabled:
        return run_sweep(cfg)
    if cfg.bench.get("batching") is not None and cfg.bench.batching.enabled:
        return run_items(cfg)
    if cfg.bench.get("long_generation") is not None and cfg.bench.long_generation.enabled:
        return run_long_generation(cfg)
    if cfg.bench.measure and not cfg.bench.frontier and int(cfg.bench.repeats) < 3:
        raise InputError(f"bench.repeats={cfg.bench.repeats}: timings are the median of at least 3 repeats")
    prefill_repeats = cfg.bench.get("prefill_repeats")
    if prefill_repeats is not None and not 1 <= int(prefill_repeats) <= int(cfg.bench.repeats):
        raise InputError(f"bench.prefill_repeats={prefill_repeats}: allowed null or 1..bench.repeats "
                         f"({cfg.bench.repeats})")
    out = output_dir(cfg)
    device = resolve_device(cfg)
    if cfg.bench.measure:
        # every row of a folder comes from one model, device, method settings and decode length;
        # rows are keyed by (method, budget, length, batch) inside it
        frontier = {"bench.memory_gib": cfg.bench.memory_gib,
                    "bench.frontier_resolution": cfg.bench.frontier_resolution,
                    "bench.frontier_min": cfg.bench.frontier_min} if cfg.bench.frontier else {}
        claim(out, fingerprint(cfg, {"device": device, "bench.decode_tokens": cfg.bench.decode_tokens,
                                     "bench.fresh_process": cfg.bench.fresh_process, **frontier},
                               compressor_skip=("tag", "budget", "method")), cfg.resume,
              ["frontier.jsonl", "frontier_probes.jsonl"] if cfg.bench.frontier else ["bench.jsonl"])
    save_run_metadata(cfg, out, make_compressor(cfg.compressor))
    if cfg.bench.plan:
        write_json_atomic(out / "plan.json", print_plan(cfg))
        if not cfg.bench.measure:
            return []
    specs = specs_of(cfg)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if cfg.bench.frontier:
        from .frontier import figure as frontier_figure, markdown as frontier_markdown, run_frontier
        per_method = [s for s in specs
                      if s["method"] != "empty_cache" and s["input_tokens"] == int(cfg.bench.lengths[0])]
        rows = run_frontier(cfg, out, model_cfg, device, per_method)
        write_json_atomic(out / "frontier.json", rows)
        title = f"{cfg.model.name} on {device}: longest input under {cfg.bench.memory_gib} GiB"
        (out / "frontier.md").write_text(frontier_markdown(rows, title), encoding="utf-8")
        frontier_figure(rows, out / "frontier.png", title)
        print((out / "frontier.md").read_text())
        return rows
    results = out / "bench.jsonl"
    done = {_key(r) for r in read_records(results, repair=True)}
    todo = [s for s in specs if _key(s) not in done]
    fresh = cfg.bench.fresh_process
    fresh = (device == "cpu") if fresh == "auto" else bool(fresh)
    runner = None

    def timed(spec):
        nonlocal runner
        from ..runner import Runner, load_model
        from .measure import measure
        if runner is None:
            model, _ = load_model(cfg.model, device, with_tokenizer=False)
            runner = Runner(model, None, **chunking(cfg.model))
        return measure(runner, spec)
    from .measure import PeakWorker
    worker = PeakWorker(model_cfg, device) if fresh else None
    try:
        for spec in tqdm(todo, desc="bench", unit="config", dynamic_ncols=True):
            row = _run_fresh(worker, spec, timed) if fresh else timed(spec)
            append_record(results, row)
    finally:
        if worker is not None:
            worker.close()
    rows = [r for r in read_records(results) if _key(r) in {_key(s) for s in specs}]
    _add_predictions(cfg, rows)
    write_json_atomic(out / "bench.json", rows)
    table = markdown(rows)
    head_adaptive = head_adaptive_markdown(rows)
    if head_adaptive:
        table += "\n" + head_adaptive
    (out / "bench.md").write_text(f"# {cfg.model.name} on {device}\n\n{table}", encoding="utf-8")
    figure(rows, out / "decode_latency.png", f"{cfg.model.name} on {device}: decoding latency")
    print(table)
    return rows


def _add_predictions(cfg, rows: list[dict]) -> None:
    """The planner's prediction beside each measured peak (its error is the planner's validation)."""
    try:
        arch = model_architecture(cfg.model)
    except Exception:
        return
    node = compressor_fields(cfg.compressor)
    for r in rows:
        if r["oom"] or r.get("peak_above_model_bytes") is None or r["method"] == "empty_cache":
            continue
        comp = None if r["method"] == "full" else snapkv.build_config(r["method"], **{**node, "budget": r["budget"]})
        p = plan(arch, r["input_tokens"], comp, batch=r["batch"], dtype=str(cfg.model.dtype),
                 attn_implementation=cfg.model.get("attn_implementation", "sdpa"), **chunking(cfg.model),
                 decode_tokens=int(cfg.bench.decode_tokens), device=resolve_device(cfg))
        r["predicted_peak_above_model_bytes"] = p["peak_above_weights_bytes"]
        r["predicted_kv_cache_bytes"] = p["kv_cache_bytes"]


@task_main("bench")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
