"""LongBench data validation, pred.py prompt rules, and the app: predict, resume, score."""
import json

import pytest

from conftest import compose
from eval.longbench.data import read_dataset
from eval.longbench.prompt import NO_CHAT_DATASETS, PROMPTS, build_input_ids, middle_truncate


def rows(n=3, dataset="hotpotqa"):
    return [{"input": f"Question {i}?", "context": "Passage text. " * 40, "answers": [f"answer {i}"],
             "length": 500 + i, "dataset": dataset, "language": "en", "all_classes": None, "_id": f"id{i}"}
            for i in range(n)]


def write(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_bad_rows_are_reported_with_file_and_line(tmp_path):
    bad = rows(2)
    del bad[1]["answers"]
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:2: missing field 'answers'"):
        read_dataset(write(tmp_path / "hotpotqa.jsonl", bad))
    (tmp_path / "x.jsonl").write_text('{"input": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1: field 'input' must be str"):
        read_dataset(tmp_path / "x.jsonl")


def test_shared_multi_news_sample_validates(shared_dir):
    data = read_dataset(shared_dir / "reference/longbench/data/multi_news.jsonl")
    assert len(data) == 200 and data[0]["dataset"] == "multi_news"


def test_middle_truncation_keeps_both_halves(smol_tokenizer):
    text = "start " + "filler " * 500 + "end"
    cut = middle_truncate(smol_tokenizer, text, 100)
    assert cut.startswith("start") and cut.endswith("end")
    assert abs(len(smol_tokenizer(cut).input_ids) - 100) <= 2


def test_chat_template_skipped_for_official_datasets(smol_tokenizer):
    row = rows(1)[0]
    for dataset in ("trec", "hotpotqa"):
        r = {**row, "context": "ctx", "input": "q", "all_classes": ["a"]}
        ids = build_input_ids(smol_tokenizer, r, dataset, 7500, "template")
        text = smol_tokenizer.decode(ids)
        assert ("<|im_start|>" in text) == (dataset not in NO_CHAT_DATASETS)
        assert text.endswith(PROMPTS[dataset].format(**r)[-10:]) or dataset not in NO_CHAT_DATASETS


def run_app(tmp_path, *extra):
    from eval.longbench.__main__ import run
    cfg = compose("longbench", ["model=tiny-llama", "compressor.budget=64", "compressor.window=8",
                                "longbench.datasets=[hotpotqa]", f"longbench.data_dir={tmp_path}",
                                "longbench.max_new_tokens=3", f"output_dir={tmp_path}/run", *extra])
    return run(cfg)


def test_app_predicts_resumes_and_scores(tmp_path):
    write(tmp_path / "hotpotqa.jsonl", rows(3))
    scores = run_app(tmp_path, "longbench.limit=2")
    pred = tmp_path / "run" / "pred" / "hotpotqa.jsonl"
    lines = [json.loads(l) for l in pred.read_text().splitlines()]
    assert [l["_id"] for l in lines] == ["id0", "id1"]
    assert set(lines[0]) >= {"_id", "pred", "answers", "all_classes", "length"}
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == scores
    assert (tmp_path / "run" / "compressor.json").exists() and (tmp_path / "run" / "versions.json").exists()
    with pred.open("a") as f:  # a crash mid-line
        f.write('{"_id": "id2", "pred": "x')
    run_app(tmp_path)
    ids = [json.loads(l)["_id"] for l in pred.read_text().splitlines()]
    assert ids == ["id0", "id1", "id2"]


def test_app_bad_input_errors(tmp_path):
    write(tmp_path / "hotpotqa.jsonl", rows(1))
    with pytest.raises(ValueError, match="longbench.datasets"):
        run_app(tmp_path, "longbench.datasets=[hotpot]")
    with pytest.raises(ValueError, match="longbench.data_dir"):
        run_app(tmp_path, "longbench.datasets=[qasper]")
    with pytest.raises(ValueError, match="kernel"):
        run_app(tmp_path, "compressor.kernel=4")


def test_cli_exits_nonzero_with_one_line(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "eval.longbench", "longbench.datasets=[nope]",
                           f"output_dir={tmp_path}"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: longbench.datasets: 'nope'")


def test_standalone_scorer(tmp_path):
    from eval.longbench.score import main
    pred = tmp_path / "pred"
    pred.mkdir()
    write(pred / "trec.jsonl", [{"pred": "Location\nx", "answers": ["Location"], "all_classes": ["Location", "Manner"],
                                 "length": 10}])
    assert main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "result.json").read_text()) == {"trec": 100.0}


def test_hub_data_zip_is_downloaded_once_and_unpacked(tmp_path, monkeypatch):
    import zipfile
    import huggingface_hub
    from eval.longbench import data
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/hotpotqa.jsonl", "".join(json.dumps(r) + "\n" for r in rows(2)))
    calls = []

    def fake_download(repo, filename, repo_type, revision):
        calls.append((repo, filename, repo_type, revision))
        return str(archive)

    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    for _ in range(2):
        assert len(read_dataset(data.dataset_file("hotpotqa", None, "abc123"))) == 2
    assert calls == [("THUDM/LongBench", "data.zip", "dataset", "abc123")]
    assert not [p for p in (tmp_path / "cache" / "longbench").iterdir() if p.name.startswith(".")]  # no temp left


def test_offline_without_data_is_one_clear_error(tmp_path, monkeypatch):
    import huggingface_hub
    from eval.longbench import data

    class ConnectError(Exception):  # what the hub client raises when there is no route (httpx's name)
        pass

    def offline(*args, **kwargs):
        raise ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ValueError, match="offline.*longbench.data_dir=DIR"):
        data.dataset_file("qasper", None)


def test_a_hub_answer_is_not_called_offline(tmp_path, monkeypatch):
    import huggingface_hub
    from eval.longbench import data

    def refused(*args, **kwargs):
        raise FileNotFoundError("Revision Not Found for url ... nope")

    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(ValueError, match="longbench.revision='nope': the hub refused") as info:
        data.dataset_file("qasper", None, "nope")
    assert "offline" not in str(info.value)


def test_duplicate_ids_and_missing_fields_name_file_and_line(tmp_path):
    dup = rows(3)
    dup[2]["_id"] = "id0"
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:3: duplicate _id 'id0' \(first on line 1\)"):
        read_dataset(write(tmp_path / "hotpotqa.jsonl", dup))
    for field in ("all_classes", "length"):
        bad = rows(2)
        del bad[1][field]
        with pytest.raises(ValueError, match=rf"hotpotqa.jsonl:2: missing field '{field}'"):
            read_dataset(write(tmp_path / "hotpotqa.jsonl", bad))


def test_out_of_memory_sample_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    from eval.runner import Runner
    write(tmp_path / "hotpotqa.jsonl", rows(3))
    real = Runner.generate
    def flaky(self, ids, *args, **kwargs):
        if ids.shape[1] > 0 and flaky.calls == 1:
            flaky.calls += 1
            raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
        flaky.calls += 1
        return real(self, ids, *args, **kwargs)
    flaky.calls = 0
    monkeypatch.setattr(Runner, "generate", flaky)
    run_app(tmp_path)
    lines = [json.loads(l) for l in (tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()]
    assert [l.get("oom", False) for l in lines] == [False, True, False]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["hotpotqa"] == {"rows": 3, "scored": 2, "oom": 1, "dataset_rows": 3}
    monkeypatch.setattr(Runner, "generate", real)
    run_app(tmp_path)  # resuming does not retry the OOM row by default
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["hotpotqa"]["oom"] == 1
    run_app(tmp_path, "longbench.retry_oom=true")
    lines = [json.loads(l) for l in (tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()]
    assert sorted(l["_id"] for l in lines) == ["id0", "id1", "id2"] and not any(l.get("oom") for l in lines)


def test_rerun_with_other_settings_is_refused_before_loading_the_model(tmp_path, monkeypatch):
    import eval.runner
    write(tmp_path / "hotpotqa.jsonl", rows(2))
    run_app(tmp_path, "longbench.limit=1")
    run_dir = tmp_path / "run"
    config_before = (run_dir / "config.yaml").read_text()
    monkeypatch.setattr(eval.runner, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ValueError) as info:
        run_app(tmp_path, "longbench.max_new_tokens=5", "compressor.kernel=5")
    message = str(info.value)
    assert "\n" not in message and "resume=restart" in message
    assert "longbench.max_new_tokens 3 -> 5" in message and "compressor.kernel 7 -> 5" in message
    assert (run_dir / "config.yaml").read_text() == config_before
    # fields that cannot change an output resume the same folder
    monkeypatch.undo()
    run_app(tmp_path, "longbench.limit=2", "device=cpu")
    assert len((run_dir / "pred" / "hotpotqa.jsonl").read_text().splitlines()) == 2
    assert (run_dir / "config.yaml").read_text() == config_before
    assert len((run_dir / "invocations.jsonl").read_text().splitlines()) == 2


def test_a_field_added_to_the_task_config_is_part_of_the_settings(tmp_path, monkeypatch):
    import eval.runner
    from snapkv.errors import InputError
    write(tmp_path / "hotpotqa.jsonl", rows(1))
    run_app(tmp_path, "+longbench.new_knob=1")
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["longbench.new_knob"] == 1
    monkeypatch.setattr(eval.runner, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(InputError, match="longbench.new_knob 1 -> 2"):
        run_app(tmp_path, "+longbench.new_knob=2")


def test_resume_restart_moves_old_results_to_a_dated_folder(tmp_path):
    write(tmp_path / "hotpotqa.jsonl", rows(2))
    run_app(tmp_path, "longbench.limit=1")
    run_app(tmp_path, "longbench.limit=1", "longbench.max_new_tokens=2", "resume=restart")
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert len(moved) == 1
    assert json.loads((moved[0] / "settings.json").read_text())["longbench.max_new_tokens"] == 3
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["longbench.max_new_tokens"] == 2
    assert len((tmp_path / "run" / "pred" / "hotpotqa.jsonl").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="resume='sometimes' is not allowed"):
        run_app(tmp_path, "resume=sometimes")


def test_changed_data_under_existing_predictions_is_refused(tmp_path):
    write(tmp_path / "hotpotqa.jsonl", rows(2))
    run_app(tmp_path, "longbench.limit=1")
    changed = rows(2)
    changed[0]["answers"] = ["something else"]
    write(tmp_path / "hotpotqa.jsonl", changed)
    with pytest.raises(ValueError, match="hotpotqa data changed under existing predictions"):
        run_app(tmp_path)


def test_standalone_scorer_never_changes_a_prediction_file(tmp_path):
    from eval.longbench.score import main
    pred = tmp_path / "pred"
    pred.mkdir()
    text = ('{"pred": "Location", "answers": ["Location"], "all_classes": ["Location", "Manner"], "length": 9}\n'
            '{"pred": "Manner", "answers": ["Location"], "all_classes": ["Location", "Manner"], "length": 9}')
    (pred / "trec.jsonl").write_text(text)  # made elsewhere: no final newline
    assert main([str(tmp_path)]) == 0
    assert (pred / "trec.jsonl").read_text() == text
    assert json.loads((tmp_path / "result.json").read_text()) == {"trec": 50.0}
    (pred / "trec.jsonl").write_text(text[:-10])
    assert main([str(tmp_path)]) == 2
    assert (pred / "trec.jsonl").read_text() == text[:-10]


def official_eval_e(path: str) -> dict:
    """A transcription of THUDM/LongBench eval.py with --e (its listdir loop and scorer_e), the
    metric functions being ours (pinned separately in test_metrics.py)."""
    import os
    import numpy as np
    from eval.longbench.metrics import DATASET_METRIC as dataset2metric

    def scorer_e(dataset, predictions, answers, lengths, all_classes):
        scores = {"0-4k": [], "4-8k": [], "8k+": []}
        for (prediction, ground_truths, length) in zip(predictions, answers, lengths):
            score = 0.
            if dataset in ["trec", "triviaqa", "samsum", "lsht"]:
                prediction = prediction.lstrip('\n').split('\n')[0]
            for ground_truth in ground_truths:
                score = max(score, dataset2metric[dataset](prediction, ground_truth, all_classes=all_classes))
            if length < 4000:
                scores["0-4k"].append(score)
            elif length < 8000:
                scores["4-8k"].append(score)
            else:
                scores["8k+"].append(score)
        for key in scores.keys():
            scores[key] = round(100 * np.mean(scores[key]), 2)
        return scores

    scores = {}
    for filename in os.listdir(path):
        if not filename.endswith("jsonl"):
            continue
        predictions, answers, lengths = [], [], []
        dataset = filename.split('.')[0]
        with open(f"{path}{filename}", "r", encoding="utf-8") as f:
            for line in f:
                data = json.loads(line)
                predictions.append(data["pred"])
                answers.append(data["answers"])
                all_classes = data["all_classes"]
                if "length" in data:
                    lengths.append(data["length"])
        scores[dataset] = scorer_e(dataset, predictions, answers, lengths, all_classes)
    return scores


def test_longbench_e_layout_is_what_official_eval_e_reads(tmp_path):
    e_rows = rows(3, dataset="hotpotqa_e")
    for row, length in zip(e_rows, (1200, 5000, 9000)):
        row["length"] = length
    write(tmp_path / "hotpotqa_e.jsonl", e_rows)
    scores = run_app(tmp_path, "longbench.datasets=[hotpotqa_e]")
    assert (tmp_path / "run" / "pred_e" / "hotpotqa.jsonl").exists()
    assert not (tmp_path / "run" / "pred").exists()
    official = official_eval_e(f"{tmp_path}/run/pred_e/")
    assert scores == {"hotpotqa_e": official["hotpotqa"]}
    # scored by hand-made predictions too, so that a zero-only run cannot hide a mismatch
    path = tmp_path / "run" / "pred_e" / "hotpotqa.jsonl"
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    for line, pred in zip(lines, ("answer 0", "answer", "nothing")):
        line["pred"] = pred
    write(path, lines)
    from eval.longbench.score import score_run
    ours, _ = score_run(tmp_path / "run")
    assert ours == {"hotpotqa_e": official_eval_e(f"{tmp_path}/run/pred_e/")["hotpotqa"]}
    assert ours["hotpotqa_e"] == {"0-4k": 100.0, "4-8k": 66.67, "8k+": 0.0}


VICUNA = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the user's questions. USER: {p} ASSISTANT:")
# What FasterDecoding/SnapKV experiments/LongBench/pred_snap.py feeds each paper model: the text
# after build_chat (tokenized with the tokenizer's BOS), the dtype, and use_fast.
PRED_SNAP = {
    "lwm-1m": ("[INST]{p}[/INST]", "float16", False),
    "longchat-7b-32k": (VICUNA, "float16", False),
    "mistral-7b-instruct-v0.2": ("{p}", "float16", False),
    "mixtral-8x7b-instruct-v0.1": ("{p}", "float16", True),
}


@pytest.mark.parametrize("model", sorted(PRED_SNAP))
def test_paper_presets_follow_pred_snap(model):
    from eval.chat import format_chat
    from eval.longbench.prompt import min_new_tokens
    wrapper, dtype, use_fast = PRED_SNAP[model]
    for overrides in ([f"model={model}"], [f"model={model}", "experiment=paper_table1"]):
        cfg = compose("longbench", overrides)
        assert cfg.model.dtype == dtype and cfg.model.use_fast_tokenizer == use_fast
        assert cfg.model.protocol == "snapkv"
        assert format_chat(None, "Summarize: X", cfg.model.chat_format) == (wrapper.format(p="Summarize: X"), True)
        assert all(min_new_tokens(d, cfg.model.protocol) == 1 for d in ("hotpotqa", "trec", "samsum", "lcc"))


def test_longbench_protocol_forces_a_token_on_samsum_only():
    from eval.longbench.prompt import min_new_tokens
    assert [min_new_tokens(d, "longbench") for d in ("hotpotqa", "samsum", "samsum_e")] == [0, 1, 1]
    with pytest.raises(ValueError, match="model.protocol='pred' is not allowed"):
        min_new_tokens("hotpotqa", "pred")


def test_paper_preset_feeds_few_shot_and_code_datasets_raw(smol_tokenizer):
    row = {**rows(1)[0], "context": "ctx", "input": "q", "all_classes": ["a"]}
    for dataset in NO_CHAT_DATASETS:
        ids = build_input_ids(smol_tokenizer, row, dataset, 7500, "llama2")
        assert "[INST]" not in smol_tokenizer.decode(ids)
    assert smol_tokenizer.decode(build_input_ids(smol_tokenizer, row, "hotpotqa", 7500, "llama2")).startswith("[INST]")
