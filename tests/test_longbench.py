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
    import subprocess, sys
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

    def fake_download(repo, filename, repo_type):
        calls.append((repo, filename, repo_type))
        return str(archive)

    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    for _ in range(2):
        assert len(read_dataset(data.dataset_file("hotpotqa", None))) == 2
    assert calls == [("THUDM/LongBench", "data.zip", "dataset")]


def test_offline_without_data_is_one_clear_error(tmp_path, monkeypatch):
    import huggingface_hub
    from eval.longbench import data

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ValueError, match="longbench.data_dir=DIR"):
        data.dataset_file("qasper", None)


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
    assert summary["hotpotqa"] == {"rows": 3, "scored": 2, "oom": 1}
