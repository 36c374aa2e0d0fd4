"""What compression cost and saved, beside every score: a setting's own compression time (a score several
settings of a shared prefill read counts for each, as its solo run pays it), its KV bytes against full
KV's and a masked cache's, and the ``cost`` every prediction record carries."""
import json
import time

import pytest
import torch
from transformers import DynamicCache

import snapkv
import snapkv.observation_window as snapkv_module
from conftest import compose
from eval.runner import Runner
from tiny_models import tiny_model

PAUSE = 0.05


def test_a_shared_score_counts_for_every_setting_that_reads_it_and_once_in_the_pass(monkeypatch):
    original = snapkv_module.window_attention

    def slow(*args, **kwargs):
        time.sleep(PAUSE)
        return original(*args, **kwargs)

    monkeypatch.setattr(snapkv_module, "window_attention", slow)
    model = tiny_model()
    layers = model.config.num_hidden_layers
    settings = [snapkv.SnapKV(budget=48, window=8, kernel=5), snapkv.SnapKV(budget=64, window=8, kernel=5),
                snapkv.FullKV()]
    with snapkv.compress(model, settings) as session, torch.no_grad():
        model(torch.randint(0, 128, (1, 150)), cache=DynamicCache(config=model.config), use_cache=True)
        per_setting, together = session.compression_seconds()
    first, second, full = per_setting
    # the second SnapKV read the window attention the first computed: it pays it as alone
    assert first >= layers * PAUSE and second >= layers * PAUSE
    assert full < PAUSE  # full KV scores nothing
    assert layers * PAUSE <= together < first + second - layers * PAUSE / 2  # computed once in the pass


def test_generations_carry_their_cost():
    model = tiny_model()
    runner = Runner(model)
    ids = torch.randint(0, 128, (1, 150))
    settings = [snapkv.FullKV(), snapkv.SnapKV(budget=48, window=8, kernel=5), snapkv.AdaKV(budget=48, window=8)]
    full, snap, ada = runner.generate_shared(ids, settings, max_new_tokens=4)
    layers, config = model.config.num_hidden_layers, model.config
    per_token = 2 * layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    for gen in (full, snap, ada):
        cost = gen.cost()
        assert cost["prompt_tokens"] == 150 and cost["full_kv_bytes"] == 150 * per_token
        assert cost["prefill_settings"] == 3 and cost["decode_tokens"] == len(gen.tokens) == 4
        assert cost["prefill_s"] > 0 and cost["compress_s"] >= 0 and cost["decode_s"] > 0
        assert cost["prefill_s"] == full.cost()["prefill_s"]  # the one pass, the same in every record
        json.dumps(cost)
    assert full.cost()["kv_cache_bytes"] == 150 * per_token and full.cost()["kept_tokens"] == 150 * layers
    assert snap.cost()["kv_cache_bytes"] == 48 * per_token and snap.cost()["kept_tokens"] == 48 * layers
    assert "masked_kv_bytes" not in snap.cost() and "masked_kv_bytes" not in full.cost()
    # AdaKV stores each head's own slots; kvpress's masking would hold the whole prompt
    assert ada.cost()["kv_cache_bytes"] == 48 * per_token and ada.cost()["masked_kv_bytes"] >= 150 * per_token
    assert snap.cost()["compress_s"] > full.cost()["compress_s"]


@pytest.mark.parametrize("query_aware", [True, False])
def test_every_longbench_record_carries_its_cost_and_scores_ignore_it(tmp_path, query_aware):
    from eval.longbench.__main__ import run
    rows = [{"input": f"Question {i}?", "context": "Passage text. " * (20 + 10 * i), "answers": [f"answer {i}"],
             "length": 100 + i, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"id{i}"}
            for i in range(2)]
    (tmp_path / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(compose("longbench", ["model=tiny-llama", "compressor.budget=64", "compressor.window=8",
                              "longbench.datasets=[hotpotqa]", f"longbench.data_dir={tmp_path}",
                              "longbench.max_new_tokens=3", f"query_aware={str(query_aware).lower()}",
                              f"output_dir={tmp_path}/run"]))
    records = [json.loads(line) for line in (tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()]
    for record in records:
        cost = record["cost"]
        assert cost["prompt_tokens"] == record["input_tokens"]
        assert 0 < cost["kv_cache_bytes"] < cost["full_kv_bytes"]
        assert cost["decode_tokens"] >= 1 and cost["prefill_settings"] == 1
    assert json.loads((tmp_path / "run" / "result.json").read_text())["hotpotqa"] >= 0
