"""Benchmark rows and the memory planner on tiny models (no timing assertions)."""
import json

import pytest
import torch

import snapkv
from conftest import compose
from snapkv.errors import InputError
from snapkv.memory import longest_fitting, plan
from tiny_models import tiny_model


def test_bench_app_rows_table_and_figure(tmp_path):
    from eval.bench.__main__ import run
    overrides = ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "bench.lengths=[128,256]",
                 "bench.budgets=[64]", "bench.decode_tokens=3", "bench.repeats=3", "bench.fresh_process=false",
                 "bench.methods=[snapkv,streamingllm]", f"output_dir={tmp_path}"]
    rows = run(compose("bench", overrides))
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data == rows
    fields = {"method", "budget", "input_tokens", "prefill_s", "decode_s_per_token", "peak_memory_bytes",
              "kv_cache_bytes", "oom"}
    assert all(fields <= set(r) for r in data)
    by = {(r["method"], r["input_tokens"]): r for r in data}
    assert by[("full", 256)]["kv_cache_bytes"] == 4 * by[("snapkv", 256)]["kv_cache_bytes"]
    assert by[("snapkv", 256)]["kv_cache_bytes"] == by[("snapkv", 256)]["predicted_kv_cache_bytes"]
    assert "empty_cache" in {r["method"] for r in data}
    assert (tmp_path / "bench.md").exists() and (tmp_path / "decode_latency.png").exists()
    run(compose("bench", overrides))  # resume: nothing measured twice
    assert len((tmp_path / "bench.jsonl").read_text().splitlines()) == len(data)


def test_a_method_sized_by_no_budget_runs_once_and_finch_reads_the_question_length(tmp_path):
    from eval.bench.__main__ import run
    overrides = ["model=tiny-llama", "compressor.window=8", "bench.lengths=[128]", "bench.budgets=[48,64]",
                 "bench.decode_tokens=2", "bench.repeats=3", "bench.prefill_repeats=1", "bench.fresh_process=false",
                 "bench.question_tokens=16", "bench.methods=[think,finch]", f"output_dir={tmp_path}"]
    rows = [r for r in run(compose("bench", overrides)) if r["method"] != "empty_cache"]
    assert sorted((r["method"], r["budget"]) for r in rows) == [("finch", 48), ("finch", 64), ("full", None),
                                                                ("think", None)]
    by = {(r["method"], r["budget"]): r for r in rows}
    assert by[("finch", 48)]["kv_cache_bytes"] < by[("finch", 64)]["kv_cache_bytes"] < by[("full", None)][
        "kv_cache_bytes"]
    assert by[("think", None)]["kv_cache_bytes"] < by[("full", None)]["kv_cache_bytes"]
    with pytest.raises(snapkv.InputError, match="bench.question_tokens=128: allowed 0 up to the shortest"):
        run(compose("bench", [*overrides[:-3], "bench.question_tokens=128", "bench.methods=[finch]",
                              f"output_dir={tmp_path / 'q'}"]))


def test_head_adaptive_rows_are_compared_with_snapkv_at_their_budget(tmp_path):
    from eval.bench.__main__ import run
    overrides = ["model=tiny-llama", "compressor.window=8", "bench.lengths=[256]", "bench.budgets=[64]",
                 "bench.decode_tokens=3", "bench.repeats=3", "bench.fresh_process=false",
                 "bench.methods=[snapkv,adakv]", f"output_dir={tmp_path}"]
    rows = {r["method"]: r for r in run(compose("bench", overrides))}
    ada, snap, full = rows["adakv"], rows["snapkv"], rows["full"]
    assert ada["kv_cache_bytes"] == snap["kv_cache_bytes"] == ada["predicted_kv_cache_bytes"]
    assert ada["kv_cache_bytes"] < ada["padded_kv_bytes"] < ada["masked_kv_bytes"] == full["kv_cache_bytes"]
    assert "padded_kv_bytes" not in snap
    table = (tmp_path / "bench.md").read_text()
    assert "## Head-adaptive caches against SnapKV" in table and "| 1 | 256 | adakv-64 | " in table


def test_batching_mode_times_items_in_flight_against_one_at_a_time(tmp_path):
    from eval.bench.__main__ import run
    overrides = ["model=tiny-llama", "model.max_length=600", "bench.batching.enabled=true", "bench.batching.short=3",
                 "bench.batching.long=1", "bench.batching.batch=2", "bench.batching.settings=[{method: full},"
                 "{method: snapkv, budget: 64, window: 8}]", "bench.batching.budget_scale=1", f"output_dir={tmp_path}"]
    result = run(compose("bench", overrides))
    assert json.loads((tmp_path / "items.json").read_text()) == result
    assert result["items"] == 4 and result["batch_sizes"] == [1, 2, 1]  # one long; short ones two at a time
    assert result["answers"] == 8 and 0 <= result["answers_equal"] <= 8 and result["speedup"] > 0
    assert "| in flight (items and settings decoded together) |" in (tmp_path / "items.md").read_text()
    with pytest.raises(snapkv.InputError, match="bench.batching.short=-1"):
        run(compose("bench", overrides + ["bench.batching.short=-1"]))


def test_a_batch_decodes_each_row_as_alone():
    from eval.runner import Runner
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    runner = Runner(model)
    for comp in (snapkv.FullKV(), snapkv.SnapKV(budget=32, window=8)):
        both = runner.generate(ids, comp, 4)
        assert both.tokens == runner.generate(ids[:1], comp, 4).tokens


def test_fewer_prefills_than_repeats_decode_each_time_from_a_copy_of_one_cache(monkeypatch):
    """bench.prefill_repeats=1: one prefill (no warm-up at the length), then every timed decode from its
    own copy of that prefill's cache; each decode equals a decode after a prefill of its own."""
    from eval.bench.measure import measure
    from eval.runner import Runner
    model = tiny_model("llama-gqa")
    runner = Runner(model)
    comp = snapkv.SnapKV(budget=32, window=8)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    runs = runner.decode_repeatedly(ids, comp, 5, 3)
    assert len(runs) == 3 and len({r.prefill_s for r in runs}) == 1
    assert all(r.tokens == runner.generate(ids, comp, 5).tokens for r in runs)
    assert all(r.cache_lengths == runs[0].cache_lengths and r.kv_cache_bytes == runs[0].kv_cache_bytes for r in runs)
    prefills, decodes = [], []
    real = runner._generate

    def spy(*args, **kwargs):
        prefills.append(1)
        out = real(*args, **kwargs)
        decodes.append(len(out) if kwargs.get("decode_repeats") else 1)
        return out
    monkeypatch.setattr(runner, "_generate", spy)
    spec = {"method": "snapkv", "budget": 32, "input_tokens": 64, "batch": 1, "decode_tokens": 4, "repeats": 3,
            "compressor": {"budget": 32, "window": 8}}
    row = measure(runner, {**spec, "prefill_repeats": 1})
    assert prefills == [1, 1] and decodes == [1, 3]        # the one-token baseline, then one prefill
    assert row["prefill_s"] > 0 and row["decode_s_per_token"] > 0 and not row["oom"]
    prefills.clear(), decodes.clear()
    measure(runner, {**spec, "prefill_repeats": 2})       # 3 decodes over 2 prefills: 2 + 1
    assert decodes == [1, 2, 1]
    prefills.clear(), decodes.clear()
    measure(runner, spec)                                  # the default: warm-up, then a prefill per repeat
    assert decodes == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("value", [0, 4])
def test_prefill_repeats_outside_one_to_repeats_is_refused(tmp_path, value):
    from eval.bench.__main__ import run
    with pytest.raises(ValueError, match=rf"bench.prefill_repeats={value}: allowed null or 1..bench.repeats \(3\)"):
        run(compose("bench", ["model=tiny-llama", f"bench.prefill_repeats={value}", f"output_dir={tmp_path}"]))


def test_bench_rejects_unknown_method(tmp_path):
    from eval.bench.__main__ import run
    with pytest.raises(ValueError, match="bench.methods"):
        run(compose("bench", ["model=tiny-llama", "bench.methods=[snapkv2]", f"output_dir={tmp_path}"]))


def test_planner_kv_bytes_match_the_real_cache():
    model = tiny_model("llama-gqa")
    cfg = snapkv.SnapKV(budget=48, window=8, kernel=5)
    ids = torch.randint(0, 128, (2, 150))
    from eval.bench.measure import kv_cache_bytes
    from transformers import DynamicCache
    for comp in (None, cfg, snapkv.PyramidKV(budget=48, window=8)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), snapkv.compress(model, comp or snapkv.FullKV()):
            model(ids, cache=cache, use_cache=True)
        assert plan(model.config, 150, comp, batch=2, dtype="float32")["kv_cache_bytes"] == kv_cache_bytes(cache)


def test_planner_lwm_frontier():
    lwm = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32)
    gib = 2**30
    eager_full = longest_fitting(lwm, 80 * gib, None, attn_implementation="eager", prefill_chunk=None)
    # HF eager attention holds a layer's L x L scores in bf16, their float32 softmax and its bf16 cast
    # at once (8 bytes an entry): about 16K; the paper's ~33K matches one bf16 copy (2 bytes an entry)
    assert 14_000 < eager_full < 18_000
    # chunked, eager attention holds a chunk's rows of scores: full KV then stops at its cache (about 68K)
    assert 60_000 < longest_fitting(lwm, 80 * gib, None, attn_implementation="eager") < 70_000
    snap = snapkv.SnapKV(budget=1024, window=16, kernel=5)
    assert plan(lwm, 380_000, snap, attn_implementation="flash_attention_2", mlp_chunk=16384)["peak_bytes"] < 80 * gib
    assert plan(lwm, 380_000, None, attn_implementation="flash_attention_2")["peak_bytes"] > 80 * gib
    # the chunked prefill to the model's trained context, and past it (issue: at most 50 GiB at 1,048,576)
    assert plan(lwm, 1_048_576, snap, attn_implementation="flash_attention_2")["peak_bytes"] < 50 * gib
    assert plan(lwm, 2_097_152, snap, attn_implementation="flash_attention_2")["peak_bytes"] < 80 * gib


def test_bisection_finds_the_frontier_to_two_percent():
    from eval.bench.frontier import bisect
    for true in (1500, 5000, 77_777):
        found, probes = bisect(lambda n, true=true: {"fits": n <= true, "input_tokens": n}, 1024, 1 << 20, 0.02)
        assert found <= true and (true - found) / true <= 0.02
        assert len(probes) < 20
    assert bisect(lambda n: {"fits": False}, 1024, 1 << 20, 0.02)[0] is None
    # seeded near a prediction: above or below the frontier, steps of 1.2x, never below the floor
    for start in (60_000, 90_000):
        found, probes = bisect(lambda n: {"fits": n <= 77_777}, start, 1 << 20, 0.02, 1.2, 1024)
        assert found <= 77_777 and (77_777 - found) / 77_777 <= 0.02 and len(probes) < 12
    found, probes = bisect(lambda n: {"fits": False, "n": n}, 5000, 1 << 20, 0.02, 1.2, 1024)
    assert found is None and probes[-1]["n"] == 1024
    assert bisect(lambda n: {"fits": True}, 1024, 4096, 0.02)[0] == 4096


def test_a_killed_or_timed_out_probe_is_not_an_oom(monkeypatch):
    import subprocess
    from eval.bench import frontier
    spec = {"method": "full", "budget": None, "input_tokens": 100, "batch": 1}

    def killed(*args, **kwargs):
        return subprocess.CompletedProcess(args, -9, "", "")

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired("measure", 1)

    monkeypatch.setattr(frontier.subprocess, "run", killed)
    assert frontier.probe({}, "cpu", spec, 1, 1) == {**spec, "fits": False, "outcome": "killed"}
    monkeypatch.setattr(frontier.subprocess, "run", slow)
    assert frontier.probe({}, "cpu", spec, 1, 1) == {**spec, "fits": False, "outcome": "timeout"}


def test_frontier_mode_measures_and_plans_each_method(tmp_path, monkeypatch):
    from eval.bench import frontier
    from eval.bench.__main__ import run
    limits = {"full": 3000, "snapkv": 40_000}          # what a cap would allow, per method
    seen = []

    def fake_probe(model_cfg, device, spec, cap, timeout):
        seen.append(spec)
        fits = spec["input_tokens"] <= limits[spec["method"]] // spec["batch"]
        return {**{k: spec[k] for k in ("method", "budget", "input_tokens", "batch")}, "fits": fits,
                "outcome": "fits" if fits else "oom"}

    monkeypatch.setattr(frontier, "probe", fake_probe)
    overrides = ["model=tiny-llama-32l", "compressor.budget=1024", "bench.methods=[snapkv]", "bench.budgets=[1024]",
                 "bench.lengths=[1024]", "bench.batch_sizes=[1,2]", "bench.frontier=true", "bench.memory_gib=2",
                 f"output_dir={tmp_path}"]
    rows = run(compose("bench", overrides))
    by = {(r["method"], r["batch"]): r for r in rows}
    assert set(by) == {("full", 1), ("snapkv", 1), ("full", 2), ("snapkv", 2)}
    for (method, batch), r in by.items():
        true = limits[method] // batch
        assert r["measured_frontier_tokens"] <= true and (true - r["measured_frontier_tokens"]) / true <= 0.02
        assert r["planned_frontier_tokens"] > 0
    assert by[("snapkv", 1)]["ratio_to_full"] == round(by[("snapkv", 1)]["measured_frontier_tokens"] /
                                                       by[("full", 1)]["measured_frontier_tokens"], 2)
    assert all(s["repeats"] == 1 and not s["warmup"] and s["compressor"].get("budget") in (None, 1024) for s in seen)
    for name in ("frontier.json", "frontier.md", "frontier.png", "frontier.pdf"):
        assert (tmp_path / name).exists()
    assert "| 1 | snapkv-1024 |" in (tmp_path / "frontier.md").read_text()
    count = len(seen)
    run(compose("bench", overrides))                     # resume: no method is searched twice
    assert len(seen) == count
    (tmp_path / "frontier.jsonl").unlink()               # interrupted inside the searches: probes are kept
    again = run(compose("bench", overrides))
    assert len(seen) == count
    assert {(r["method"], r["batch"], r["measured_frontier_tokens"]) for r in again} == \
        {(r["method"], r["batch"], r["measured_frontier_tokens"]) for r in rows}


def test_planner_terms_per_method_and_architecture():
    import pytest as _pytest
    base = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    length = 8192

    def transient(method, chunk=None):
        return plan(base, length, method, prefill_chunk=chunk)["prefill_transient_bytes"]
    snap, stream, h2o = (transient(m) for m in (snapkv.SnapKV(budget=1024), snapkv.StreamingLLM(budget=1024),
                                                 snapkv.H2O(budget=1024)))
    repeat = plan(base, length, snapkv.SnapKV(budget=1024, gqa="repeat"))
    assert stream <= snap < h2o                     # one pass: q over every position dwarfs the window's votes
    # chunked: no attention; window x L beside a chunk's buffers; H2O's every query in one chunk, 1024 x L blocks
    chunked = [transient(m, 512) for m in (snapkv.StreamingLLM(budget=1024), snapkv.SnapKV(budget=1024),
                                           snapkv.H2O(budget=1024))]
    assert chunked[0] < chunked[1] < chunked[2] and chunked[1] < snap
    assert repeat["kv_cache_bytes"] == 4 * plan(base, length, snapkv.SnapKV(budget=1024))["kv_cache_bytes"]
    eager = plan(base, length, None, attn_implementation="eager", dtype="bfloat16", prefill_chunk=None)
    assert eager["prefill_transient_bytes"] >= 8 * 8 * length * length  # bf16 scores, float32 softmax, bf16 cast
    eager = plan(base, length, None, attn_implementation="eager", dtype="bfloat16")["prefill_transient_bytes"]
    assert 8 * 8 * 2048 * length <= eager < 8 * 8 * 4096 * length  # chunked: a 2,048-row chunk's, all heads
    qwen3_moe = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    weights = plan(qwen3_moe, 1, None)["weights_bytes"] / 2 / 1e9
    assert 29 < weights < 32                          # Qwen3-30B-A3B: 30.5B parameters
    mixtral = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                   num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8)
    assert 46 < plan(mixtral, 1, None)["weights_bytes"] / 2 / 1e9 < 47.5   # Mixtral-8x7B: 46.7B
    with _pytest.raises(ValueError, match="model_type='gpt2': the memory planner knows"):
        plan(dict(base, model_type="gpt2"), 100, None)


def test_h2o_plans_the_query_chunk_of_the_device_it_runs_on(monkeypatch):
    """H2O scores 128 query rows at a time on a CPU (the chunk stays in cache) and 1,024 elsewhere (fewer
    kernel launches); the planner's term follows the device, and so does the real chunking."""
    import snapkv.methods.h2o as h2o
    arch = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000}
    from snapkv.memory import Shape
    comp = snapkv.H2O(budget=256)

    def term(device, nbytes):
        return comp.compression_bytes(Shape.of(arch, device), 8192, 1, nbytes)
    # a KV head's 4 query heads' float32 scores (their softmax taken in place), the chunk's diagonal mask
    assert term("cuda", 4) - term("cpu", 4) == 4 * (1024 - 128) * 8192 * 4 + (1024**2 - 128**2)
    # below float32 the float32 probabilities are a buffer of their own
    assert term("cuda", 2) - term("cpu", 2) == 4 * (1024 - 128) * 8192 * (2 + 4) + (1024**2 - 128**2)
    planned = {d: plan(arch, 8192, comp, dtype="float32", device=d)["prefill_transient_bytes"] for d in ("cpu", "cuda")}
    assert planned["cuda"] > planned["cpu"]
    assert h2o.query_chunk(torch.device("cpu")) == 128 and h2o.query_chunk(torch.device("cuda", 0)) == 1024
    rows = []
    real = torch.Tensor.masked_fill_
    monkeypatch.setattr(torch.Tensor, "masked_fill_", lambda self, *a: rows.append(self.shape[-2]) or real(self, *a))
    h2o.accumulated_attention(torch.randn(1, 4, 300, 16), torch.randn(1, 2, 300, 16))
    assert rows == [128, 128, 128, 128, 44, 44]              # 3 chunks of query rows x 2 KV heads


def test_a_method_without_a_memory_term_is_not_planned():
    from dataclasses import dataclass
    from snapkv.errors import InputError
    from snapkv.method import Method

    @dataclass
    class Unplanned(Method):
        method = "unplanned"

    base = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(InputError, match="compressor.method='unplanned': the memory planner has no estimate"):
        plan(base, 4096, Unplanned(budget=64, window=8))
    assert plan(base, 4096, snapkv.FullKV())["kv_cache_bytes"] == plan(base, 4096, None)["kv_cache_bytes"]


def test_shared_prefill_plan_holds_every_kept_cache_and_the_largest_transient():
    from snapkv.memory import plan_shared
    from eval.runner import model_architecture
    from conftest import compose as compose_cfg
    arch = model_architecture(compose_cfg("bench", ["model=tiny-llama-32l"]).model)
    snap, h2o = snapkv.SnapKV(budget=1024), snapkv.H2O(budget=1024)
    one = plan(arch, 8192, snap, dtype="float32")
    alone = plan_shared(arch, 8192, [snap], dtype="float32")
    assert alone["peak_bytes"] == one["peak_bytes"] and alone["kv_cache_bytes"] == one["kv_cache_bytes"]
    both = plan_shared(arch, 8192, [snapkv.FullKV(), snap, h2o], dtype="float32")
    full = plan(arch, 8192, None, dtype="float32")
    assert both["kv_cache_bytes"] == full["kv_cache_bytes"] + 2 * one["kv_cache_bytes"]
    assert both["prefill_transient_bytes"] == plan(arch, 8192, h2o, dtype="float32")["prefill_transient_bytes"]
    assert both["peak_bytes"] > full["peak_bytes"]
    # the full KV of the layer being compressed is held once, not once per setting
    assert both["prefill_kv_held_bytes"] < full["prefill_kv_held_bytes"] + 2 * one["prefill_kv_held_bytes"]
    # decoding together: every row padded to the largest cache (full's), one row of logits each
    together = plan_shared(arch, 8192, [snapkv.FullKV(), snap, h2o], dtype="float32", decode_together=True)
    assert together["decode_peak_bytes"] == 3 * (full["decode_peak_bytes"] - full["weights_bytes"]) + \
        full["weights_bytes"]
    assert together["prefill_peak_bytes"] == both["prefill_peak_bytes"]


def test_sweep_mode_times_solo_against_shared_and_checks_the_tokens(tmp_path):
    from eval.bench.__main__ import run
    cfg = compose("bench", ["model=tiny-llama", "bench.sweep.enabled=true", "bench.sweep.budget_scale=0.0625",
                            "bench.sweep.rows=1", "bench.sweep.max_new_tokens=4", f"output_dir={tmp_path}"])
    result = run(cfg)
    assert result["settings"] == ["FullKV", "SnapKV 64", "SnapKV 128", "SnapKV 256", "H2O 256"]
    assert result["exact"] and all(r["tokens_equal"] for r in result["rows"])
    assert result["solo_s"] > 0 and result["shared_s"] > 0 and result["ideal_s"] > 0
    assert json.loads((tmp_path / "sweep.json").read_text())["speedup"] == result["speedup"]
    assert "shared prefill, exact" in (tmp_path / "sweep.md").read_text()
    assert result["together_s"] > 0 and result["together_speedup"] > 0
    assert 0 <= result["together_answers_differ"] <= 5 and 0 <= result["together_token_agreement"] <= 1
    assert "decoding together" in (tmp_path / "sweep.md").read_text()


def test_token_agreement_counts_answers_and_positions():
    from eval.bench.sweep import agreement
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == (0, 1.0)
    assert agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5, 6]]) == (2, 4 / 6)


def test_sweep_mode_bad_settings_name_the_field(tmp_path):
    from eval.bench.__main__ import run
    with pytest.raises(ValueError, match="bench.sweep.settings='table2'"):
        run(compose("bench", ["model=tiny-llama", "bench.sweep.enabled=true", "bench.sweep.settings=table2",
                              f"output_dir={tmp_path}"]))


def test_plan_only_prints_the_planner_without_weights(tmp_path):
    from eval.bench.__main__ import run
    rows = run(compose("bench", ["model=tiny-llama-32l", "bench.plan=true", "bench.measure=false",
                                 "bench.plan_lengths=[4096,16384]", "bench.memory_gib=1", f"output_dir={tmp_path}"]))
    assert rows == []
    plan_rows = json.loads((tmp_path / "plan.json").read_text())
    assert [r["input_tokens"] for r in plan_rows if "input_tokens" in r] == [4096, 16384, 4096, 16384]
    fitting = {r["method"]: r["longest_fitting_tokens"] for r in plan_rows if "longest_fitting_tokens" in r}
    assert fitting["full"] < fitting["snapkv"]


@pytest.mark.slow
def test_the_prefill_memory_section_reports_bytes_per_token_time_and_plans(tmp_path):
    """``bench.prefill_memory.enabled``: per prefill (chunked, one pass) the measured and planned bytes per prompt token
    with the floor and the layer-wise minimum, the time ratio, the longest input planned per memory size."""
    from eval.bench.__main__ import run
    cfg = compose("bench", ["model=tiny-llama", "bench.prefill_memory.enabled=true",
                            "bench.prefill_memory.lengths=[512,1024]", "bench.prefill_memory.time_lengths=[256]",
                            "bench.prefill_memory.memory_gib=[24,80]", "bench.prefill_memory.plan_lengths=[1048576]",
                            "model.prefill_chunk=128",
                            f"output_dir={tmp_path}"])
    result = run(cfg)
    assert [(row["method"], row["prefill_chunk"]) for row in result["memory"]] == [("snapkv", 128), ("snapkv", None)]
    for row in result["memory"]:
        # a tiny model's few hundred kB per length are within the runtime's noise: the slope is a number, not pinned
        assert isinstance(row["measured_bytes_per_token"], float) and set(row["measured_peaks"]) == {512, 1024}
        assert row["planned_bytes_per_token"] > 0
        assert row["floor_bytes_per_token"] == (64 + 2 * 2 * 16) * 4  # tiny-llama: hidden 64, 2 KV heads of 16
        assert row["layerwise_minimum_bytes_per_token"] == row["floor_bytes_per_token"] + 64 * 4 + 4 * 4
    assert result["time"][0]["input_tokens"] == 256 and result["time"][0]["time_ratio"] > 0
    longest = {(row["method"], row["prefill_chunk"]): row for row in result["plan"]["longest"]}
    assert longest[("snapkv", 2048)]["80"] > 2 * longest[("snapkv", None)]["80"] > longest[("full", None)]["80"]
    assert (tmp_path / "prefill_memory.md").read_text().startswith("# Prefill memory: tiny-llama")
    with pytest.raises(InputError, match="bench.prefill_memory.lengths"):
        run(compose("bench", ["bench.prefill_memory.enabled=true", "bench.prefill_memory.lengths=[1024]",
                              f"output_dir={tmp_path}/bad"]))


def test_the_speculative_section_compares_greedy_lookup_and_assisted_decoding(tmp_path):
    """``bench.speculative.enabled``: per prompt length and setting, greedy, prompt lookup and assisted decoding
    (here the model drafting for itself), their forward passes and speed, each equal to greedy."""
    from eval.bench.__main__ import run
    cfg = compose("bench", ["model=tiny-llama", "bench.speculative.enabled=true", "bench.speculative.lengths=[300]",
                            "bench.speculative.budget=64", "bench.speculative.decode_tokens=12",
                            "bench.speculative.draft_model=tiny-llama", f"output_dir={tmp_path}"])
    result = run(cfg)
    assert [(row["setting"], row["decoding"]) for row in result["rows"]] == [
        (setting, way) for setting in ("FullKV", "SnapKV 64") for way in ("greedy", "prompt_lookup", "assisted")]
    assert all(row["equals_greedy"] for row in result["rows"])
    assert all(row["passes"] == 12 for row in result["rows"] if row["decoding"] == "greedy")
    assert (tmp_path / "speculative.md").read_text().startswith("# Speculative decoding over compressed caches")
    with pytest.raises(InputError, match="bench.speculative.lengths: 100000 tokens"):
        run(compose("bench", ["model=tiny-llama", "bench.speculative.enabled=true",
                              "bench.speculative.lengths=[100000]", f"output_dir={tmp_path}/bad"]))
