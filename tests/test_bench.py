"""Benchmark rows and the memory planner on tiny models (no timing assertions)."""
import json

import pytest
import torch

import snapkv
from conftest import compose
from snapkv.memory import longest_fitting, plan
from tiny_models import tiny_model


def test_bench_app_rows_table_and_figure(tmp_path):
    from eval.bench.__main__ import run
    overrides = ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "bench.lengths=[128,256]",
                 "bench.budgets=[64]", "bench.decode_tokens=3", "bench.repeats=1", "bench.fresh_process=false",
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


def test_bench_rejects_unknown_method(tmp_path):
    from eval.bench.__main__ import run
    with pytest.raises(ValueError, match="bench.methods"):
        run(compose("bench", ["model=tiny-llama", "bench.methods=[snapkv2]", f"output_dir={tmp_path}"]))


def test_planner_kv_bytes_match_the_real_cache():
    model = tiny_model("llama-gqa")
    cfg = snapkv.SnapKVConfig(budget=48, window=8, kernel=5)
    ids = torch.randint(0, 128, (2, 150))
    from eval.bench.measure import kv_cache_bytes
    from transformers import DynamicCache
    for comp in (None, cfg, snapkv.PyramidKVConfig(budget=48, window=8)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), snapkv.compress(model, comp or snapkv.FullConfig()):
            model(ids, cache=cache, use_cache=True)
        assert plan(model.config, 150, comp, batch=2, dtype="float32")["kv_cache_bytes"] == kv_cache_bytes(cache)


def test_planner_lwm_frontier():
    lwm = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32)
    gib = 2**30
    eager_full = longest_fitting(lwm, 80 * gib, None, attn_implementation="eager")
    assert 25_000 < eager_full < 40_000  # the paper: full KV runs out at ~33K on one A100-80GB
    snap = snapkv.SnapKVConfig(budget=1024, window=16, kernel=5)
    assert plan(lwm, 380_000, snap, attn_implementation="flash_attention_2", mlp_chunk=16384)["peak_bytes"] < 80 * gib
    assert plan(lwm, 380_000, None, attn_implementation="flash_attention_2")["peak_bytes"] > 80 * gib


def test_chunked_mlp_is_exact():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 100))
    with torch.no_grad():
        ref = model(ids).logits
        with snapkv.chunked_mlp(model, 16):
            got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(model.model.layers[0].mlp)
