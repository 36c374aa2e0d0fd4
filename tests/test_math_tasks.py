"""AIME25 and MATH-500 (eval.math): kvpress's scorer on cases kvpress itself scored, the math-verify
column (and its absence), the data (hub, local files and folders, bad rows), kvpress's prompt, and the app
on tiny-llama: records and a table, per-row generation lengths, resume, shared prefill, query-agnostic
runs, out of memory, one-line errors. The fixtures and where their schema comes from:
tests/fixtures/math/README.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compose
from eval.math import data, score
from eval.math.prompt import encode
from snapkv.errors import InputError

FIXTURES = ROOT / "tests" / "fixtures" / "math"
CASES = json.loads((FIXTURES / "kvpress_cases.json").read_text())
TIMINGS = ("cost",)  # measurements, not results


def fixture_rows(dataset: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{dataset}.jsonl").read_text().splitlines() if line.strip()]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def results(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in lines(path)]


# --- kvpress's scorer ------------------------------------------------------------------------------

@pytest.mark.parametrize("dataset", ["aime25", "math500"])
def test_extraction_and_verdicts_are_kvpress_calculate_metrics(dataset):
    """Every case as kvpress's own ``extract_boxed`` / ``score_aime`` / ``calculate_metrics`` scored it
    (tests/fixtures/math/write_kvpress_cases.py, run against kvpress's evaluation/ folder)."""
    expected = CASES[dataset]
    cases = CASES["cases"]
    assert [score.kvpress_answer(dataset, c["prediction"]) for c in cases] == expected["extract_boxed"]
    assert [score.kvpress_correct(dataset, c["prediction"], c["answer"]) for c in cases] == expected["score"]
    records = [{"predicted_answer": c["prediction"], "answer": c["answer"]} for c in cases]
    assert score.kvpress_metrics(dataset, records) == expected["calculate_metrics"]


def test_the_two_extractions_differ_as_kvpress_does():
    assert score.extract_boxed_last("\\boxed{12} then \\boxed{70}") == "70"
    assert score.extract_boxed_first("\\boxed{12} then \\boxed{70}") == "12"
    assert score.extract_boxed_last("no box } here") == "no box "  # the whole text up to a brace
    assert score.extract_boxed_first("no box } here") is None
    assert score.extract_boxed_first("\\boxed{\\frac{1}{2}}") == "\\frac{1"  # no brace balancing
    assert score.kvpress_correct("aime25", "\\boxed{70}", 70)  # str(answer)
    assert score.kvpress_metrics("aime25", []) == {"correct": 0, "answered": 0, "accuracy": None, "total": 0}


# --- math-verify -----------------------------------------------------------------------------------

MATH_VERIFY_CASES = [  # (case index in kvpress_cases.json, verdict)
    (0, True), (3, True), (4, True), (5, True), (6, True), (10, True), (13, True), (14, True), (9, False)]


def test_math_verify_column_decides_equivalence():
    pytest.importorskip("math_verify")
    cases = CASES["cases"]
    got = [score.math_verify_correct(cases[i]["prediction"], cases[i]["answer"]) for i, _ in MATH_VERIFY_CASES]
    assert got == [want for _, want in MATH_VERIFY_CASES]
    assert score.math_verify_correct("\\boxed{49}", "50") is False
    # where kvpress's string comparison and math-verify disagree
    assert not score.kvpress_correct("math500", "\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}")
    assert score.math_verify_correct("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}")


def test_without_math_verify_the_column_is_none_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
    assert score.math_verify_functions() is None
    assert score.math_verify_correct("\\boxed{50}", "50") is None
    records = [{"predicted_answer": "\\boxed{50}", "answer": "50"},
               {"predicted_answer": None, "answer": "1", "oom": True}]
    scores = score.score_records("math500", records, dataset_rows=500)
    assert scores["math_verify"] is None and scores["notes"] == [score.MATH_VERIFY_MISSING]
    assert scores["kvpress"] == {"correct": 1, "answered": 1, "accuracy": 1.0, "total": 1}
    assert (scores["items"], scores["scored"], scores["oom"], scores["dataset_rows"]) == (2, 1, 1, 500)
    text = score.table([scores])
    assert "| math500 | 1 | 100.0 | 1 | – | 0 | 1 |" in text and "math-verify is not installed" in text


# --- data ------------------------------------------------------------------------------------------

def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_local_copies_in_every_layout_give_the_same_rows(tmp_path):
    rows = fixture_rows("math500")
    jsonl, info = data.load("math500", str(FIXTURES / "math500.jsonl"))
    assert jsonl == rows and info["rows"] == 3 and info["revision"] is None
    assert info["source"] == str((FIXTURES / "math500.jsonl").resolve()) and info["sha256"] == data.digest(rows)
    parquet = write_parquet(tmp_path / "one.parquet", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    hub_layout = tmp_path / "hub"
    write_parquet(hub_layout / "data" / "test-00000-of-00001.parquet", rows)
    write_parquet(hub_layout / "data" / "train-00000-of-00001.parquet", rows[:1])  # another split: not read
    (hub_layout / "README.md").write_text("card")
    from datasets import Dataset, DatasetDict
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"test": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    for path in (parquet, tmp_path / "rows.json", hub_layout, tmp_path / "saved", tmp_path / "saved_dict"):
        got, got_info = data.load("math500", str(path))
        assert got == rows and got_info["sha256"] == info["sha256"], path


def test_the_hub_copy_is_read_with_its_commit(tmp_path, monkeypatch):
    import huggingface_hub
    folder = tmp_path / "datasets--alessiodevoto--aime25" / "snapshots" / "0123abc"
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", fixture_rows("aime25"))
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append((a, k)) or str(folder))
    rows, info = data.load("aime25", None, "main")
    assert rows == fixture_rows("aime25")
    assert calls == [(("alessiodevoto/aime25",), {"repo_type": "dataset", "revision": "main"})]
    assert (info["source"], info["revision"]) == ("hub:alessiodevoto/aime25", "0123abc")


def test_offline_without_a_local_copy_is_one_line_naming_the_field(monkeypatch):
    import huggingface_hub

    def offline(*_, **__):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nmore")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(InputError) as err:
        data.load("math500", None, "main")
    message = str(err.value)
    assert message.startswith("math.data: no local copy given and alessiodevoto/math500@main could not be read from "
                              "the Hugging Face hub (ConnectionError: Failed to resolve")
    assert "math.data=DIR" in message and "\n" not in message


def _bad(tmp_path, change) -> str:
    rows = fixture_rows("aime25")
    change(rows[1])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("answer_prefix"), r"row 2: no 'answer_prefix' \(kvpress's columns: context, question, "),
    (lambda r: r.update(max_new_tokens=0), r"row 2: 'max_new_tokens' must be a positive integer, got 0"),
    (lambda r: r.update(question=None), r"row 2: 'question' must be a string, got NoneType"),
    (lambda r: r.update(answer=[1]), r"row 2: 'answer' must be a string or a number, got list"),
])
def test_bad_rows_are_one_line_errors_naming_where(tmp_path, change, message):
    with pytest.raises(InputError, match=r"^math\.data=.*bad\.jsonl: " + message) as err:
        data.load("aime25", _bad(tmp_path, change))
    assert "\n" not in str(err.value)


def test_missing_paths_and_other_files_are_refused(tmp_path):
    with pytest.raises(InputError, match=r"^math\.data=/nonexistent/x\.jsonl: no such file or folder$"):
        data.load("aime25", "/nonexistent/x.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"rows\.csv: not a parquet, jsonl, json file$"):
        data.load("aime25", str(tmp_path / "rows.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty: the folder holds no data files"):
        data.load("aime25", str(tmp_path / "empty"))


# --- the prompt ------------------------------------------------------------------------------------

def test_prompt_is_kvpress_pipeline_preprocess(smol_tokenizer):
    """The same ids as eval.ruler.kvpress.encode (the RULER set's transcription of the pipeline) and the
    parts the pipeline makes: the context before the template's split, then question + template tail +
    answer prefix."""
    from eval.ruler import kvpress as ruler_kvpress
    row = {**fixture_rows("aime25")[0], "answer_prefix": "Answer:"}
    ruler_row = {"input": row["context"] + row["question"] + row["answer_prefix"], "query_at": len(row["context"]),
                 "answer_prefix": row["answer_prefix"]}
    for chat_format in ("template", "none"):
        ids, question = encode(smol_tokenizer, row["context"], row["question"], row["answer_prefix"], chat_format)
        assert (ids, question) == ruler_kvpress.encode(smol_tokenizer, ruler_row, chat_format)
    ids, question = encode(smol_tokenizer, row["context"], row["question"], row["answer_prefix"], "template")
    assert smol_tokenizer.decode(ids[-question:]) == row["question"] + "<|im_end|>\n<|im_start|>assistant\nAnswer:"
    assert smol_tokenizer.decode(ids[:-question]).endswith("<|im_start|>user\n ")
    ids, question = encode(smol_tokenizer, row["context"], row["question"], "", "none")
    assert smol_tokenizer.decode(ids[:-question]) == smol_tokenizer.bos_token + " "
    assert smol_tokenizer.decode(ids[-question:]) == row["question"] + "\n"
    ids, question = encode(smol_tokenizer, row["context"], row["question"], "", "llama2")  # no kvpress counterpart
    assert smol_tokenizer.decode(ids[-question:]).strip() == row["question"] + "[/INST]" and question < len(ids)


def test_stop_ids_and_generation_lengths(smol_tokenizer):
    from eval.math.predict import MathTask
    cfg = compose("math", ["model=tiny-llama", f"math.data={FIXTURES / 'aime25.jsonl'}"])
    task = MathTask()
    task.check(cfg)
    items = task.items(cfg)
    model = type("M", (), {"generation_config": type("G", (), {"eos_token_id": [7, 8]})()})()
    prompt = task.prompt(items[0], model, smol_tokenizer)
    assert prompt.stop_ids == [7, 8, smol_tokenizer.eos_token_id] and prompt.max_new_tokens == 32000
    assert 0 < prompt.question_tokens < len(prompt.ids)
    cfg = compose("math", ["model=tiny-llama", f"math.data={FIXTURES / 'aime25.jsonl'}", "math.max_new_tokens=64",
                           "math.limit=2"])
    task = MathTask()
    task.check(cfg)
    assert len(task.items(cfg)) == 2 and task.prompt(task.items(cfg)[1], model, smol_tokenizer).max_new_tokens == 64
    task.bar.close()


# --- the app ---------------------------------------------------------------------------------------

def overrides(tmp_path, dataset="aime25", *extra):
    return ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", f"math.dataset={dataset}",
            f"math.data={FIXTURES / (dataset + '.jsonl')}", "math.max_new_tokens=4", f"output_dir={tmp_path}/run",
            *extra]


def run_app(tmp_path, *extra, dataset="aime25"):
    from eval.math.__main__ import run
    return run(compose("math", overrides(tmp_path, dataset, *extra)))


def test_app_writes_records_scores_and_a_table_then_resumes(tmp_path, capsys):
    scores = run_app(tmp_path, dataset="math500")
    run_dir = tmp_path / "run"
    pred = run_dir / "pred" / "math500.jsonl"
    records = lines(pred)
    rows = fixture_rows("math500")
    assert [r["index"] for r in records] == [0, 1, 2]
    for r, row in zip(records, rows):
        assert (r["question"], r["answer"], r["unique_id"], r["level"]) == (row["question"], row["answer"],
                                                                           row["unique_id"], row["level"])
        assert r["max_new_tokens"] == 4 and r["output_tokens"] <= 4 and r["input_tokens"] > 0
        text = r["predicted_answer"]
        assert r["kvpress_answer"] == score.extract_boxed_first(text)
        assert r["kvpress_correct"] == score.kvpress_correct("math500", text, row["answer"])
        assert r["answered"] == ("boxed{" in text)
        assert r["math_verify"] == score.math_verify_correct(text, row["answer"])
        assert r["hit_max_new_tokens"] == (r["output_tokens"] == 4) and r["cost"]["decode_tokens"] == r["output_tokens"]
        assert "context" not in r and "answer_prefix" not in r
    assert json.loads((run_dir / "scores.json").read_text()) == scores
    assert scores["kvpress"]["total"] == 3 and scores["dataset_rows"] == 3 and scores["dataset"] == "math500"
    table = (run_dir / "result.txt").read_text()
    assert "kvpress accuracy %" in table and "math-verify accuracy %" in table and "| math500 | 3 |" in table
    assert "| math500 | 3 |" in capsys.readouterr().out
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["math.data_source"] == str((FIXTURES / "math500.jsonl").resolve())
    assert settings["math.data_sha256"] == data.digest(rows) and settings["math.chat_format"] == "none"
    assert json.loads((run_dir / "dataset.json").read_text())["rows"] == 3
    # a crash in the middle of writing the third record
    pred.write_text("".join(json.dumps(r) + "\n" for r in records[:2]) + '{"index": 2, "pred')
    run_app(tmp_path, dataset="math500")
    again = results(pred)
    assert [r["index"] for r in again] == [0, 1, 2] and again == results(run_dir / "pred" / "math500.jsonl")
    assert again[2] == {k: v for k, v in records[2].items() if k not in TIMINGS}  # greedy: the same answer
    run_app(tmp_path, dataset="math500")  # nothing left to do
    assert [r["index"] for r in lines(pred)] == [0, 1, 2]
    # the report's table of the run
    from eval.report.__main__ import run as report
    report(compose("report", [f"report.runs={tmp_path}", f"report.out={tmp_path}/report"]))
    md = (tmp_path / "report" / "math.md").read_text()
    assert "| math500 | tiny-llama | SnapKV 64 (window 8) | 3 |" in md and "math-verify accuracy %" in md
    assert "kvpress_accuracy" in (tmp_path / "report" / "math.csv").read_text().splitlines()[0]


def test_each_row_generates_up_to_its_own_max_new_tokens(tmp_path, monkeypatch):
    """No override: the row's ``max_new_tokens`` (kvpress's 32000 for AIME25) goes to the runner; here the
    runner is told to stop after 2 so the test stays short. The token bar counts what was generated."""
    from eval.math import predict
    from eval.runner import Runner
    real, asked = Runner.generate, []

    def short(self, ids, compressor, max_new_tokens, **kwargs):
        asked.append(max_new_tokens)
        return real(self, ids, compressor, 2, **kwargs)
    monkeypatch.setattr(Runner, "generate", short)
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.count = kwargs, 0
            bars.append(self)

        def update(self, n):
            self.count += n

        def close(self):
            pass
    monkeypatch.setattr(predict, "tqdm", Bar)
    run_app(tmp_path, "math.max_new_tokens=null", "math.limit=2")
    records = lines(tmp_path / "run" / "pred" / "aime25.jsonl")
    assert asked == [32000, 32000] and [r["max_new_tokens"] for r in records] == [32000, 32000]
    assert all(r["output_tokens"] == 2 and r["hit_max_new_tokens"] is False for r in records)
    assert len(bars) == 1 and bars[0].kwargs["unit"] == "tok" and bars[0].count == 4


def test_a_group_of_settings_prefills_each_problem_once(tmp_path, monkeypatch):
    """Three settings in one shared-prefill job: one prefill per problem, and each setting's records are
    those of its solo run."""
    from eval.math.__main__ import run
    from eval.runner import Runner
    from eval.sweep_groups import group_jobs, write_group
    base = [o for o in overrides(tmp_path, "aime25", "math.limit=2")
            if not o.startswith(("compressor.", "output_dir="))]  # the sweep's folders
    jobs = [["compressor=full"], ["compressor=snapkv", "compressor.budget=64", "compressor.window=8"],
            ["compressor=streamingllm", "compressor.budget=16"]]
    [members] = group_jobs(jobs, lambda o: compose("math", base + [f"hydra.sweep.dir={tmp_path}/shared", *o],
                                                   hydra_node=True))
    folders = [Path(m.output_dir).relative_to(tmp_path / "shared").parts for m in members]
    assert [f[:2] for f in folders] == [("aime25", "tiny-llama")] * 3  # the dataset's own folders
    group = write_group(tmp_path / "shared", members)
    prefills, real = [], Runner._prefill

    def count(self, session, ids, **kwargs):
        prefills.append(ids.shape[1])
        return real(self, session, ids, **kwargs)
    monkeypatch.setattr(Runner, "_prefill", count)
    run(compose("math", base + members[0].overrides + [f"shared_prefill.group={group}",
                                                       f"output_dir={members[0].output_dir}"]))
    assert len(prefills) == 2  # two problems, one prefill each for the three settings
    monkeypatch.setattr(Runner, "_prefill", real)
    for job, member in zip(jobs, members):
        solo = tmp_path / "solo" / Path(member.output_dir).name
        run(compose("math", base + job + [f"output_dir={solo}"]))
        shared = Path(member.output_dir)
        assert json.loads((shared / "settings.json").read_text()) == json.loads((solo / "settings.json").read_text())
        assert results(shared / "pred" / "aime25.jsonl") == results(solo / "pred" / "aime25.jsonl")


def test_query_agnostic_runs_append_the_question_part(tmp_path, monkeypatch):
    from eval.runner import Runner
    real, seen = Runner.generate, []

    def watch(self, ids, compressor, max_new_tokens, **kwargs):
        seen.append((ids.shape[1], kwargs.get("question_tokens", 0)))
        return real(self, ids, compressor, max_new_tokens, **kwargs)
    monkeypatch.setattr(Runner, "generate", watch)
    run_app(tmp_path, "query_aware=false", "math.limit=1")
    [(length, question)] = seen
    assert 0 < question < length
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["query_aware"] is False


def test_out_of_memory_is_recorded_and_retried_on_request(tmp_path, monkeypatch):
    from eval.runner import Runner
    real = Runner.generate

    def flaky(self, ids, *args, **kwargs):
        flaky.calls += 1
        if flaky.calls == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(self, ids, *args, **kwargs)
    flaky.calls = 0
    monkeypatch.setattr(Runner, "generate", flaky)
    scores = run_app(tmp_path)
    pred = tmp_path / "run" / "pred" / "aime25.jsonl"
    records = lines(pred)
    assert [r.get("oom", False) for r in records] == [False, True, False]
    assert records[1]["predicted_answer"] is None and "cost" not in records[1]
    assert (scores["items"], scores["scored"], scores["oom"], scores["kvpress"]["total"]) == (3, 2, 1, 2)
    monkeypatch.setattr(Runner, "generate", real)
    run_app(tmp_path)  # resuming does not retry it by default
    assert sum(bool(r.get("oom")) for r in lines(pred)) == 1
    run_app(tmp_path, "math.retry_oom=true")
    records = lines(pred)
    assert sorted(r["index"] for r in records) == [0, 1, 2] and not any(r.get("oom") for r in records)


def test_the_run_without_math_verify_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    scores = run_app(tmp_path, "math.limit=1")
    [record] = lines(tmp_path / "run" / "pred" / "aime25.jsonl")
    assert record["math_verify"] is None and isinstance(record["kvpress_correct"], bool)
    assert scores["math_verify"] is None and scores["notes"] == [score.MATH_VERIFY_MISSING]
    assert "math-verify is not installed" in (tmp_path / "run" / "result.txt").read_text()


def test_changed_data_under_existing_records_is_refused(tmp_path):
    copy = tmp_path / "rows.jsonl"
    copy.write_text((FIXTURES / "aime25.jsonl").read_text())
    run_app(tmp_path, f"math.data={copy}", "math.limit=1")
    rows = fixture_rows("aime25")
    rows[2]["answer"] = "46"
    copy.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"holds results made with other settings \(math\.data_sha256 "):
        run_app(tmp_path, f"math.data={copy}", "math.limit=1")


def test_the_fingerprint_knows_the_section():
    from eval.math.predict import MathTask
    from eval.settings import DERIVED, HARMLESS, TASK_SECTIONS, fingerprint
    assert "math" in TASK_SECTIONS
    assert set(HARMLESS["math"]) == {"limit", "retry_oom"} and set(DERIVED["math"]) == {"data", "revision"}
    cfg = compose("math", ["model=tiny-llama", f"math.data={FIXTURES / 'aime25.jsonl'}", "output_dir=/tmp/unused"])
    task = MathTask()
    task.check(cfg)
    settings = fingerprint(cfg, task.settings(cfg))
    assert settings["math.dataset"] == "aime25" and settings["math.max_new_tokens"] is None
    assert "math.data" not in settings and "math.limit" not in settings and "math.revision" not in settings


def test_run_folders_are_per_dataset():
    cfg = compose("math", ["model=tiny-llama", "math.dataset=math500"], hydra_node=True)
    assert str(cfg.hydra.run.dir) == "results/runs/math/math500/tiny-llama/snapkv-b1024-w32-k7-maxpool-mean"


@pytest.mark.parametrize("extra, message", [
    (["math.dataset=gsm8k"], r"^math\.dataset='gsm8k' is not allowed; choose one of aime25, math500$"),
    (["math.limit=0"], r"^math\.limit=0 must be a positive integer \(or null\)$"),
    (["math.max_new_tokens=-1"], r"^math\.max_new_tokens=-1 must be a positive integer \(or null\)$"),
    (["math.data=/nonexistent/rows.jsonl"], r"^math\.data=/nonexistent/rows\.jsonl: no such file or folder$"),
])
def test_bad_input_is_one_line(tmp_path, extra, message):
    with pytest.raises(InputError, match=message) as err:
        run_app(tmp_path, *extra)
    assert "\n" not in str(err.value)


def test_cli_offline_without_data_exits_2_naming_the_field(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "eval.math", "model=tiny-llama", f"output_dir={tmp_path}/run",
                           f"hydra.run.dir={tmp_path}/hydra"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: math.data: no local copy given and alessiodevoto/aime25@main could not be read")
    assert last.endswith("and pass math.data=DIR")
