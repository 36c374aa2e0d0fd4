"""Items in flight (``batch.items``): batches of prompts equal their one-at-a-time runs, per-item records,
resume, OOM splitting and failures inside a batch, auto sizing, the fingerprint and the report's label."""
import json

import pytest
import torch

import snapkv
from conftest import compose
from eval.batching import AutoSize, Entry, batch_options, cut_batches
from eval.engine import Prompt
from eval.runner import Runner
from test_longbench import write
from tiny_models import tiny_model

SETTINGS = [snapkv.FullKV(), snapkv.SnapKV(budget=40, window=8, kernel=3), snapkv.StreamingLLM(budget=40),
            snapkv.AdaKV(budget=40, window=8), snapkv.H2O(budget=40)]


@pytest.mark.parametrize("prefill", ["each", "padded"])
@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("question", [0, 4])
def test_a_batch_of_prompts_decodes_each_as_alone(prefill, together, question):
    """Prompts of different lengths, every setting on each (some shorter than the budget), prefilled one
    after another or left-padded into one batch: each item's tokens under each setting equal its own
    run's, with and without a question part appended after the compression, decoded per setting or
    together."""
    model = tiny_model("llama-gqa")
    runner = Runner(model)
    runner.weight_bytes = 2**40  # as on a GPU, where the weights dominate: every setting in one merged batch
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (150, 97, 30, 120)]
    batched = runner.generate_items(prompts, SETTINGS, 6, together=together, question_tokens=question,
                                    prefill=prefill)
    for prompt, per_setting in zip(prompts, batched):
        alone = runner.generate_shared(torch.tensor([prompt]), SETTINGS, 6, question_tokens=question)
        assert [g.tokens for g in per_setting] == [g.tokens for g in alone]
        assert all(g.input_tokens == len(prompt) for g in per_setting)


def test_rows_stop_on_their_own_in_a_batch():
    model = tiny_model("llama-gqa")
    runner = Runner(model)
    prompts = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 60)]
    alone = [runner.generate(torch.tensor([p]), SETTINGS[1], 8) for p in prompts]
    stop = alone[1].tokens[2]  # the second prompt stops at its third token
    batched = runner.generate_items(prompts, [SETTINGS[1]], 8, stop_ids=[stop], prefill="padded")
    assert [row[0].tokens for row in batched] == [row[0].tokens for row in runner.generate_items(
        prompts, [SETTINGS[1]], 8, stop_ids=[stop])]
    expected = [runner.generate(torch.tensor([p]), SETTINGS[1], 8, stop_ids=[stop]).tokens for p in prompts]
    assert [row[0].tokens for row in batched] == expected and len(expected[1]) <= 3


def test_settings_whose_rows_a_padded_batch_would_change_take_none():
    assert snapkv.SnapKV(budget=64).takes_padded_batch() and snapkv.AdaKV(budget=128).takes_padded_batch()
    assert not snapkv.SnapKV(budget=None, ratio=0.5).takes_padded_batch()  # a share of the padded width
    assert not snapkv.PyramidKV(budget=64).takes_padded_batch() and not snapkv.KVzip(budget=64).takes_padded_batch()


def test_batch_options_name_the_field_and_accept_what_users_type():
    assert batch_options({"batch": {"items": "4"}}).items == 4
    assert batch_options({"batch": {"items": "auto"}}).largest == 16
    assert not batch_options({}).batched
    for bad in (0, -2, "many", True, 1.5):
        with pytest.raises(snapkv.InputError, match=r"^batch.items=.* is not allowed; give a positive integer"):
            batch_options({"batch": {"items": bad}})
    with pytest.raises(snapkv.InputError, match="batch.margin=2 must be a number in"):
        batch_options({"batch": {"items": 2, "margin": 2}})


def test_batches_share_their_generation_and_take_the_longest_first():
    def entry(key, length, answer=32, question=0):
        return Entry(key, Prompt(list(range(length)), answer, [2]), ["run"], question)
    entries = [entry("a", 100), entry("b", 900), entry("c", 500), entry("d", 300, answer=512), entry("e", 700)]
    sizes = []
    batches = cut_batches(entries, lambda length, answer: sizes.append((length, answer)) or (2 if length > 600 else 3))
    assert [[e.item for e in b] for b in batches] == [["b", "e"], ["c", "a"], ["d"]]
    assert sizes == [(900, 32), (500, 32), (300, 512)]


def test_auto_plans_the_largest_batch_that_fits():
    from eval.runner import model_architecture
    from snapkv.memory import plan_shared
    settings = [snapkv.FullKV(), snapkv.SnapKV(budget=1024)]
    budget = int(2 * 2**30 * 0.9)
    for prefill in ("padded", "each"):
        cfg = compose("longbench", ["model=tiny-llama-32l", "batch.items=auto", "batch.memory_gib=2",
                                    f"batch.prefill={prefill}"])
        size = AutoSize(batch_options(cfg), cfg.model, settings, "cpu", together=True)
        n = size(4096, 64)
        assert 1 < n < 16
        assert size.peak_above_weights(n, 4096, 64) <= budget < size.peak_above_weights(n + 1, 4096, 64)
        assert size(512, 64) >= n  # shorter prompts: at least as many
        if prefill == "padded":  # one padded batch: the planner's batch of n prompts
            planned = plan_shared(model_architecture(cfg.model), 4096, settings, batch=n, dtype="float32",
                                  decode_tokens=64, decode_together=True, device="cpu", padded=True)
            assert size.peak_above_weights(n, 4096, 64) == planned["peak_above_weights_bytes"]
            padded_n = n
        else:  # one prefill at a time: no padding mask, one prompt's transient
            assert n >= padded_n


def run_longbench(tmp_path, *extra, data="hotpotqa"):
    from eval.longbench.__main__ import run
    cfg = compose("longbench", ["model=tiny-llama", "compressor.budget=64", "compressor.window=8",
                                f"longbench.datasets=[{data}]", f"longbench.data_dir={tmp_path}",
                                "longbench.max_new_tokens=4", f"output_dir={tmp_path}/run", *extra])
    return run(cfg)


def longbench_rows(n=7):
    return [{"input": f"Question {i}?", "context": "Passage text. " * (10 + 15 * i), "answers": [f"answer {i}"],
             "length": 100 + i, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"id{i}"}
            for i in range(n)]


def predictions(tmp_path, folder="run") -> dict:
    lines = [json.loads(line) for line in (tmp_path / folder / "pred" / "hotpotqa.jsonl").read_text().splitlines()]
    return {line["_id"]: line for line in lines}


def test_longbench_with_items_in_flight_records_each_item_once_as_alone(tmp_path):
    write(tmp_path / "hotpotqa.jsonl", longbench_rows())
    run_longbench(tmp_path, f"output_dir={tmp_path}/alone")
    run_longbench(tmp_path, "batch.items=3")
    alone, batched = predictions(tmp_path, "alone"), predictions(tmp_path)
    assert sorted(batched) == sorted(alone) and len(batched) == 7
    assert [batched[k]["pred"] for k in sorted(alone)] == [alone[k]["pred"] for k in sorted(alone)]
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["batch.items"] == 3 and settings["batch.prefill"] == "each" and "batch.items" not in json.loads(
        (tmp_path / "alone" / "settings.json").read_text())
    with pytest.raises(snapkv.InputError, match="batch.items"):  # a rerun never mixes batched records with others
        run_longbench(tmp_path)
    run_longbench(tmp_path, "batch.items=3")  # resume: every record is there
    assert len((tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()) == 7


def test_a_batch_out_of_memory_splits_and_only_the_guilty_item_records_it(tmp_path, monkeypatch):
    write(tmp_path / "hotpotqa.jsonl", longbench_rows())
    real_items, real_one = Runner.generate_items, Runner.generate_shared
    sizes = []

    def holds_guilty(tokenizer, prompts):
        return any("Question 4?" in tokenizer.decode(p) for p in prompts)

    def items(self, prompts, *args, **kwargs):
        sizes.append(len(prompts))
        if holds_guilty(self.tokenizer, prompts):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_items(self, prompts, *args, **kwargs)

    def one(self, ids, *args, **kwargs):
        if holds_guilty(self.tokenizer, ids.tolist()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_one(self, ids, *args, **kwargs)

    monkeypatch.setattr(Runner, "generate_items", items)
    monkeypatch.setattr(Runner, "generate", lambda self, ids, c, *a, **k: one(self, ids, [c], *a, **k)[0])
    run_longbench(tmp_path, "batch.items=4")
    got = predictions(tmp_path)
    assert {k for k, line in got.items() if line.get("oom")} == {"id4"} and len(got) == 7
    assert sizes[0] == 4 and 2 in sizes  # the batch holding id4 split in halves, and again


def test_an_item_failing_inside_a_batch_stops_the_run_with_its_traceback_and_a_rerun_resumes(tmp_path,
                                                                                            monkeypatch):
    write(tmp_path / "hotpotqa.jsonl", longbench_rows())
    real = Runner.generate_items
    calls = []

    def items(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise ValueError("a tokenizer bug in this item")
        return real(self, prompts, *args, **kwargs)
    monkeypatch.setattr(Runner, "generate_items", items)
    with pytest.raises(ValueError, match="a tokenizer bug"):
        run_longbench(tmp_path, "batch.items=3")
    first = predictions(tmp_path)
    assert len(first) == 3  # the first batch's records are written
    monkeypatch.setattr(Runner, "generate_items", real)
    run_longbench(tmp_path, "batch.items=3")
    lines = (tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()
    assert len(lines) == 7 and len({json.loads(line)["_id"] for line in lines}) == 7


def test_a_shared_group_batches_its_settings_and_runs_the_unbatchable_item_by_item(tmp_path):
    from eval.longbench.__main__ import run
    write(tmp_path / "hotpotqa.jsonl", longbench_rows(5))
    members = [{"compressor": {"method": "snapkv", "budget": 64, "window": 8, "kernel": 7, "pooling": "maxpool",
                               "gqa": "mean", "tag": "a"}, "output_dir": str(tmp_path / "snap")},
               {"compressor": {"method": "pyramidkv", "budget": 64, "window": 8, "kernel": 7, "pooling": "maxpool",
                               "gqa": "mean", "beta": 20, "tag": "b"}, "output_dir": str(tmp_path / "pyramid")}]
    group = tmp_path / "group.json"
    group.write_text(json.dumps({"settings": members}))
    base = ["model=tiny-llama", f"longbench.data_dir={tmp_path}", "longbench.datasets=[hotpotqa]",
            "longbench.max_new_tokens=4"]
    run(compose("longbench", base + [f"shared_prefill.group={group}", "batch.items=2",
                                     f"output_dir={tmp_path}/snap"]))
    for name, comp in (("snap", "snapkv"), ("pyramid", "pyramidkv")):
        solo = ["compressor=" + comp, "compressor.budget=64", "compressor.window=8", f"output_dir={tmp_path}/{name}1"]
        run(compose("longbench", base + solo))
        assert [predictions(tmp_path, name)[k]["pred"] for k in sorted(predictions(tmp_path, name))] == \
            [predictions(tmp_path, name + "1")[k]["pred"] for k in sorted(predictions(tmp_path, name + "1"))]


def test_a_needle_grid_with_items_in_flight_names_every_cell_in_flight(tmp_path, monkeypatch):
    from eval.gridcells import in_flight
    from eval.needle.__main__ import run
    from eval.runner import Runner as R
    seen = []
    real = R.generate_items

    def items(self, prompts, *args, **kwargs):
        seen.append(len(in_flight(tmp_path / "needle.jsonl")))
        return real(self, prompts, *args, **kwargs)
    monkeypatch.setattr(R, "generate_items", items)
    cfg = compose("needle", ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "needle.haystack=noise",
                             "needle.lengths=[200,300]", "needle.depths=[0,50,100]", "batch.items=3",
                             f"output_dir={tmp_path}"])
    run(cfg)
    cells = [json.loads(line) for line in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert len(cells) == 6 and not (tmp_path / "running.json").exists()
    assert seen == [3, 3]


def test_the_report_marks_batched_runs():
    from eval.report.collect import run_label
    compressor = {"method": "snapkv", "budget": 1024, "window": 32, "kernel": 7, "pooling": "maxpool", "gqa": "mean"}
    assert run_label({"compressor": compressor}).endswith("1024")
    assert run_label({"compressor": compressor, "batch": {"items": "auto"}}).endswith(" · batched")
    assert run_label({"compressor": compressor, "batch": {"items": 1}, "query_aware": False}).endswith(
        " · query-agnostic")
