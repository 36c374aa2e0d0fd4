"""RULER as an engine task: prompts (chat format or RULER's template, answer prefix after), the query
split of every task, records, resume, scores, export, bad input."""
import json
from pathlib import Path

import pytest

import snapkv
from conftest import SHARED, compose
from eval.ruler.generate import TASK_CONFIGS, TASKS, generate, parts
from eval.ruler.predict import RulerTask, Sample, table, write_scores

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ruler"
ESSAYS = SHARED / "haystack" / "paul_graham_essays"
QUERY_WORDS = {"niah": "mentioned in the provided text?", "vt": "Question: Find all variables",
               "cwe": "Question: What are the 10 most common", "fwe": "Question: Do not provide",
               "qa": "Question:"}


def section(*extra):
    return compose("ruler", ["model=tiny-llama", f"ruler.squad={FIXTURES / 'squad_tiny.json'}",
                             f"ruler.hotpotqa={FIXTURES / 'hotpotqa_tiny.json'}", f"ruler.essays={ESSAYS}",
                             *extra])


class FakeModel:
    generation_config = None


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("template", [None, "meta-chat"])
def test_every_task_splits_at_its_query_and_ends_with_the_answer_prefix(smol_tokenizer, task, template):
    if TASK_CONFIGS[task][1].get("type_haystack") == "essay" and not ESSAYS.is_dir():
        pytest.skip("the essay haystack needs ../shared")
    cfg = section("ruler.lengths=[1024]", "ruler.samples=1", "model.chat_format=template",
                  f"ruler.template={template or 'null'}")
    task_ = RulerTask()
    task_.check(cfg)
    task_.prepare(cfg, smol_tokenizer, [Sample(task, 1024, 0)])
    prompt = task_.prompt(Sample(task, 1024, 0), FakeModel(), smol_tokenizer)
    row = task_.rows[(task, 1024)][0]
    context, query, prefix = parts(row)
    before = smol_tokenizer.decode(prompt.ids[:-prompt.question_tokens])
    after = smol_tokenizer.decode(prompt.ids[-prompt.question_tokens:])
    words = QUERY_WORDS[task.split("_")[0]]
    assert words in after and words not in before[-len(context) // 4:]
    assert after.rstrip().endswith(prefix.strip())  # the answer prefix last, after the chat wrapper
    if template is None:
        assert "<|im_start|>assistant" in after and after.index("<|im_start|>assistant") < after.index(prefix.strip())
    else:
        assert after.startswith(query.lstrip()[:10]) or query.lstrip()[:10] in after
    assert prompt.fields["outputs"] == row["outputs"]


def test_sample_i_does_not_depend_on_how_many_are_drawn(smol_tokenizer):
    for task in ("niah_single_1", "vt", "cwe", "fwe"):
        assert generate(task, 1024, 2, smol_tokenizer) == generate(task, 1024, 3, smol_tokenizer)[:2]


def run_app(tmp_path, *extra):
    from eval.ruler.__main__ import run
    return run(compose("ruler", ["model=tiny-llama", "ruler.tasks=[niah_single_1,vt]", "ruler.lengths=[1024]",
                                 "compressor.budget=64", "compressor.window=8", f"output_dir={tmp_path}/run",
                                 *extra]))


def test_the_app_records_resumes_and_scores(tmp_path):
    scores = run_app(tmp_path, "ruler.samples=1")
    assert set(scores["1024"]["tasks"]) == {"niah_single_1", "vt"} and scores["1024"]["complete"] is False
    path = tmp_path / "run" / "pred" / "1024" / "vt.jsonl"
    first = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in first] == [0] and set(first[0]) >= {"pred", "outputs", "length", "input_tokens"}
    run_app(tmp_path, "ruler.samples=2")  # more samples extend the run: sample 0 is not redone
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1] and lines[0] == first[0]
    assert json.loads((tmp_path / "run" / "scores.json").read_text())["1024"]["counts"]["vt"]["samples"] == 2
    with pytest.raises(snapkv.InputError, match="ruler.seed 42 -> 7"):
        run_app(tmp_path, "ruler.samples=2", "ruler.seed=7")


def test_scores_average_the_tasks_and_mark_out_of_memory(tmp_path):
    pred = tmp_path / "pred" / "4096"
    pred.mkdir(parents=True)
    (pred / "vt.jsonl").write_text(json.dumps({"index": 0, "pred": "X1 X2", "outputs": ["X1", "X2"]}) + "\n"
                                   + json.dumps({"index": 1, "pred": None, "outputs": ["X3"], "oom": True}) + "\n")
    (pred / "qa_1.jsonl").write_text(json.dumps({"index": 0, "pred": "no", "outputs": ["Paris", "France"]}) + "\n")
    scores = write_scores(tmp_path, [4096], ["vt", "qa_1"])
    assert scores["4096"]["tasks"] == {"vt": 100.0, "qa_1": 0.0} and scores["4096"]["average"] == 50.0
    assert scores["4096"]["counts"]["vt"] == {"samples": 2, "oom": 1, "nulls": "0/1"}
    assert "| average | 50.00 (2/13 tasks) |" in table(scores)


def test_export_writes_rulers_layout_without_a_model(tmp_path):
    from eval.ruler.__main__ import run
    paths = run(compose("ruler", ["model=tiny-llama", "ruler.tasks=[niah_single_1]", "ruler.lengths=[1024]",
                                  "ruler.samples=3", f"ruler.export={tmp_path}/data", f"output_dir={tmp_path}/run"]))
    assert paths == [tmp_path / "data" / "1024" / "niah_single_1" / "validation.jsonl"]
    import gzip
    expected = gzip.open(FIXTURES / "base" / "1024" / "niah_single_1" / "validation.jsonl.gz", "rt").read()
    assert paths[0].read_text() == expected  # RULER's own prepare.py output, line for line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("ruler.tasks=[niah_single_9]", "ruler.tasks: 'niah_single_9' is not allowed; choose from niah_single_1"),
    ("ruler.lengths=[0]", "ruler.lengths=0 must be a positive integer"),
    ("ruler.samples=0", "ruler.samples=0 must be a positive integer"),
    ("ruler.template=chatml", "ruler.template='chatml' is not allowed"),
])
def test_bad_settings_name_the_field(tmp_path, override, message):
    with pytest.raises(snapkv.InputError, match=message):
        run_app(tmp_path, override)


def test_query_agnostic_runs_append_the_query_after_compression(tmp_path):
    scores = run_app(tmp_path, "ruler.samples=1", "query_aware=false")
    assert set(scores["1024"]["tasks"]) == {"niah_single_1", "vt"}
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["query_aware"] is False
