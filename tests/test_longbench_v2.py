"""LongBench v2: official pred.py prompts, truncation and extraction, result.py accuracy, the app."""
import hashlib
import json
import os
import re

import pytest

from conftest import compose
from eval.longbench_v2.data import read_rows
from eval.longbench_v2.extract import extract_answer
from eval.longbench_v2.prompt import (COT, COT_ANSWER, TEMPLATES, ZERO_SHOT, _DATA, build, fill,
                                      middle_truncate, question_at)
from eval.longbench_v2.score import accuracy, table
from snapkv.errors import InputError


def rows(n=3):
    return [{"_id": f"q{i}", "domain": "Single-Document QA", "sub_domain": "Academic",
             "difficulty": ("easy", "hard")[i % 2], "length": ("short", "medium", "long")[i % 3],
             "question": f"  Which item is number {i}? ", "choice_A": " one", "choice_B": "two ",
             "choice_C": "three", "choice_D": "four", "answer": "ABCD"[i % 4],
             "context": "\n Some passage text about items. " * 60 + f"The item is {i}.\n"} for i in range(n)]


def write_json(path, items):
    path.write_text(json.dumps(items))
    return path


# --- transcriptions of THUDM/LongBench pred.py and result.py (commit 2e00731) ------------------

def official_extract_answer(response):
    """pred.py ``extract_answer``, verbatim."""
    response = response.replace('*', '')
    match = re.search(r'The correct answer is \(([A-D])\)', response)
    if match:
        return match.group(1)
    else:
        match = re.search(r'The correct answer is ([A-D])', response)
        if match:
            return match.group(1)
        else:
            return None


def official_truncate(prompt, tokenizer, max_len):
    """pred.py ``query_llm``'s truncation for a model of model2path.json (a Hugging Face tokenizer)."""
    input_ids = tokenizer.encode(prompt)
    if len(input_ids) > max_len:
        input_ids = input_ids[:max_len//2] + input_ids[-max_len//2:]
        prompt = tokenizer.decode(input_ids, skip_special_tokens=True)
    return prompt


def official_prompt(template, item, cot=None):
    """pred.py ``get_pred``'s substitution (``template_0shot_cot_ans`` also replaces ``$COT$``)."""
    context = item['context']
    prompt = template.replace('$DOC$', context.strip()).replace('$Q$', item['question'].strip()).replace('$C_A$', item['choice_A'].strip()).replace('$C_B$', item['choice_B'].strip()).replace('$C_C$', item['choice_C'].strip()).replace('$C_D$', item['choice_D'].strip())  # noqa: E501  (pred.py's line)
    if cot is not None:
        prompt = prompt.replace('$COT$', cot)
    return prompt


def official_result(results_dir, compensated=False):
    """result.py, verbatim but for its folder and ``compensated`` flag; returns result.txt's text."""
    files = os.listdir(results_dir)
    output = ["Model\tOverall\tEasy\tHard\tShort\tMedium\tLong"]
    for file in files:
        filename = os.path.join(results_dir, file)
        try:
            pred_data = json.load(open(filename, encoding='utf-8'))
        except Exception:
            pred_data = [json.loads(line) for line in open(filename, encoding='utf-8')]
        easy, hard, short, medium, long = 0, 0, 0, 0, 0
        easy_acc, hard_acc, short_acc, medium_acc, long_acc = 0, 0, 0, 0, 0
        for pred in pred_data:
            acc = int(pred['judge'])
            if compensated and pred["pred"] == None:  # noqa: E711  (as result.py has it)
                acc = 0.25
            if pred["difficulty"] == "easy":
                easy += 1
                easy_acc += acc
            else:
                hard += 1
                hard_acc += acc

            if pred['length'] == "short":
                short += 1
                short_acc += acc
            elif pred['length'] == "medium":
                medium += 1
                medium_acc += acc
            else:
                long += 1
                long_acc += acc

        name = '.'.join(file.split('.')[:-1])
        output.append(name+'\t'+str(round(100*(easy_acc+hard_acc)/len(pred_data), 1))+'\t'+str(round(100*easy_acc/easy, 1))+'\t'+str(round(100*hard_acc/hard, 1))+'\t'+str(round(100*short_acc/short, 1))+'\t'+str(round(100*medium_acc/medium, 1))+'\t'+str(round(100*long_acc/long, 1)))  # noqa: E501  (result.py's line)
    return '\n'.join(output)


# --- prompts, truncation, extraction ------------------------------------------------------------

def test_templates_are_the_official_files():
    pinned = {"0shot": "68a162252bc9ff71d5d7abca3d69bb31aac3c35f832d657a2866f2018b8a6950",
              "0shot_cot": "6cc33d92fd8f611662b756c1f10f302c541ca005b58c46d5f3188ac3a939bfe8",
              "0shot_cot_ans": "85ec59df4ac0e27aabbc619a7ca5cf3ae1787dd5a76cf51a18944eb52c91955f"}
    for name, digest in pinned.items():
        assert hashlib.sha256((_DATA / f"{name}.txt").read_bytes()).hexdigest() == digest
        assert TEMPLATES[name] == (_DATA / f"{name}.txt").read_text(encoding="utf-8")


EXTRACTIONS = [
    ("The correct answer is (B)", "B"),
    ("**The correct answer is (C)**", "C"),                  # '*' removed first
    ("The correct answer is *(A)*.", "A"),
    ("The correct answer is D.", "D"),                       # the second pattern
    ("The correct answer is Apple", "A"),                    # which also takes a word's first letter
    ("The correct answer is B, as (A) is wrong. The correct answer is (C)", "C"),  # (X) is searched first
    ("The correct answer is (A). The correct answer is (B)", "A"),                 # the first match
    ("The correct answer is (E)", None),
    ("the correct answer is (A)", None),                     # case-sensitive
    ("The correct answer is: (A)", None),
    ("The correct answer is  (A)", None),
    ("Answer: (A)", None),
    ("", None),
]


@pytest.mark.parametrize("response,letter", EXTRACTIONS)
def test_answer_extraction_is_pred_py(response, letter):
    assert extract_answer(response) == official_extract_answer(response) == letter


def test_prompt_is_the_template_substitution():
    row = rows(1)[0]
    doc = row["context"].strip()
    expected = ("Please read the following text and answer the question below.\n\n<text>\n" + doc + "\n</text>\n\n"
                "What is the correct answer to this question: Which item is number 0?\nChoices:\n(A) one\n(B) two\n"
                "(C) three\n(D) four\n\nFormat your response as follows: "
                "\"The correct answer is (insert answer here)\".")
    assert fill(TEMPLATES[ZERO_SHOT], row) == official_prompt(TEMPLATES[ZERO_SHOT], row) == expected
    cot = fill(TEMPLATES[COT], row)
    assert cot.startswith("Please read the following text and answer the questions below.")
    assert cot.endswith("(D) four\n\nLet\u2019s think step by step:")
    answer = fill(TEMPLATES[COT_ANSWER], row, cot="I think B.")
    assert answer == official_prompt(TEMPLATES[COT_ANSWER], row, cot="I think B.")
    assert doc not in answer and "The text is too long and omitted here.\n\nWhat is the correct" in answer
    assert answer.endswith("Let\u2019s think step by step: I think B.\n\nBased on the above, what is the single, most "
                           "likely answer choice? Format your response as follows: \"The correct answer is "
                           "(insert answer here)\".")


def test_substitution_quirks_are_kept():
    """One replace chain: a value holding a later placeholder has it replaced; $COT$ is replaced last."""
    row = {**rows(1)[0], "context": "see $Q$ and $C_D$", "question": "why $C_A$?"}
    prompt = fill(TEMPLATES[ZERO_SHOT], row)
    assert prompt == official_prompt(TEMPLATES[ZERO_SHOT], row)
    assert "see Which" not in prompt and "see why one? and four" in prompt
    assert fill(TEMPLATES[COT_ANSWER], row, cot="$Q$") == official_prompt(TEMPLATES[COT_ANSWER], row, cot="$Q$")
    assert "step by step: $Q$" in fill(TEMPLATES[COT_ANSWER], row, cot="$Q$")


@pytest.mark.parametrize("max_len", [100, 101, 257])
def test_middle_truncation_is_pred_py(smol_tokenizer, max_len):
    prompt = fill(TEMPLATES[ZERO_SHOT], {**rows(1)[0], "context": "Start here. " + "filler words " * 400 + "End."})
    cut = middle_truncate(smol_tokenizer, prompt, max_len)
    assert cut == official_truncate(prompt, smol_tokenizer, max_len)
    assert cut.startswith("Please read the following text") and cut.endswith("(insert answer here)\".")
    ids = smol_tokenizer.encode(prompt)
    kept = ids[:max_len // 2] + ids[-((max_len + 1) // 2):]  # -max_len//2 rounds up: an odd max_len keeps max_len ids
    assert len(kept) == max_len and cut == smol_tokenizer.decode(kept, skip_special_tokens=True)
    short = fill(TEMPLATES[ZERO_SHOT], rows(1)[0])
    assert middle_truncate(smol_tokenizer, short, 10_000) is short


def test_truncation_comes_before_the_chat_wrapper(smol_tokenizer):
    row = {**rows(1)[0], "context": "filler words " * 400}
    raw, _, truncated = build(smol_tokenizer, row, ZERO_SHOT, 200, "none")
    wrapped, _, _ = build(smol_tokenizer, row, ZERO_SHOT, 200, "template")
    assert truncated and len(raw) == 200
    assert len(wrapped) > 200 and smol_tokenizer.decode(wrapped).startswith("<|im_start|>system")


SPLIT_CASES = [(template, fmt, max_len) for template in (ZERO_SHOT, COT, COT_ANSWER)
               for fmt in ("none", "template", "llama2") for max_len in (10_000, 300)]


@pytest.mark.parametrize("template,chat_format,max_len", SPLIT_CASES)
def test_question_tokens_start_right_after_the_document(smol_tokenizer, template, chat_format, max_len):
    from eval.chat import format_chat
    row = {**rows(1)[0], "context": "Passage words go here. " * 80 + "The document ends here."}
    ids, question_tokens, truncated = build(smol_tokenizer, row, template, max_len, chat_format,
                                            cot="Step one. Step two." if template == COT_ANSWER else None)
    assert truncated == (max_len == 300 and template != COT_ANSWER)
    prompt = middle_truncate(smol_tokenizer, fill(TEMPLATES[template], row, "Step one. Step two."
                                                  if template == COT_ANSWER else None), max_len)
    at = question_at(template, prompt)
    after = "\n\nWhat is the correct answer" if template == COT_ANSWER else "\n</text>\n\nWhat is the correct answer"
    assert prompt[at:].startswith(after)
    before = "omitted here." if template == COT_ANSWER else "The document ends here."
    assert prompt[:at].endswith(before)
    text, _ = format_chat(smol_tokenizer, prompt, chat_format)
    boundary = text.find(prompt) + at
    context_text = smol_tokenizer.decode(ids[:len(ids) - question_tokens])
    question_text = smol_tokenizer.decode(ids[len(ids) - question_tokens:])
    # the context part is the text before the boundary (a token straddling it goes with the question)
    assert text[:boundary].startswith(context_text) and boundary - len(context_text) <= 2
    assert question_text.endswith(text[boundary:]) and len(question_text) - len(text[boundary:]) <= 2
    assert before[:-2] in context_text[-len(before) - 2:]


def test_question_part_lost_in_truncation_is_an_error(smol_tokenizer):
    row = {**rows(1)[0], "question": "a long question " * 100}
    with pytest.raises(InputError, match=r"longbench_v2.max_length=100: the prompt of row 'q0'"):
        build(smol_tokenizer, row, ZERO_SHOT, 100, "none")


# --- result.py accuracy ---------------------------------------------------------------------------

def graded(difficulty, length, judge, pred="A"):
    return {"_id": f"{difficulty}{length}{judge}{pred}", "difficulty": difficulty, "length": length, "judge": judge,
            "pred": pred, "answer": "A"}


HAND_MADE = [graded("easy", "short", True), graded("easy", "short", False, "B"), graded("easy", "long", True),
             graded("hard", "medium", False, None), graded("hard", "medium", True), graded("hard", "long", False, None),
             graded("hard", "short", False, "C")]


@pytest.mark.parametrize("compensated", [False, True])
def test_accuracy_is_result_py(tmp_path, compensated):
    from eval.longbench_v2.score import main
    results = tmp_path / "results"
    results.mkdir()
    (results / "model-a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HAND_MADE))
    (results / "model-b_cot.json").write_text(json.dumps(HAND_MADE[:4]))  # result.py also reads a JSON array
    official = official_result(results, compensated)
    assert main([str(results)] + (["--compensated"] if compensated else [])) == 0
    ours = (results / "result.txt").read_text()
    assert ours.splitlines()[0] == official.splitlines()[0]
    assert sorted(ours.splitlines()[1:]) == sorted(official.splitlines()[1:])
    scores = json.loads((results / "scores.json").read_text())
    assert set(scores) == {"model-a", "model-b_cot"}
    expected = ({"Overall": 42.9, "Easy": 66.7, "Hard": 25.0, "Short": 33.3, "Medium": 50.0, "Long": 50.0}
                if not compensated else
                {"Overall": 50.0, "Easy": 66.7, "Hard": 37.5, "Short": 33.3, "Medium": 62.5, "Long": 62.5})
    assert scores["model-a"] == expected
    assert main([str(results)]) == 0  # scores.json and summary.json are not read as predictions
    assert set(json.loads((results / "scores.json").read_text())) == {"model-a", "model-b_cot"}


def test_empty_buckets_and_oom_rows():
    assert accuracy([graded("easy", "short", True)]) == {"Overall": 100.0, "Easy": 100.0, "Hard": None,
                                                         "Short": 100.0, "Medium": None, "Long": None}
    assert table({"x": accuracy([graded("hard", "long", False)])}) == (
        "Model\tOverall\tEasy\tHard\tShort\tMedium\tLong\nx\t0.0\tNone\t0.0\tNone\tNone\t0.0")


# --- data -----------------------------------------------------------------------------------------

def test_data_json_and_jsonl_are_read_and_checked(tmp_path):
    assert [r["_id"] for r in read_rows(write_json(tmp_path / "data.json", rows(3)))] == ["q0", "q1", "q2"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(2)))
    assert len(read_rows(tmp_path / "rows.jsonl")) == 2
    bad = rows(2)
    bad[1]["answer"] = "E"
    with pytest.raises(InputError, match=r"data.json row 2: field 'answer' is 'E'; allowed: A, B, C, D"):
        read_rows(write_json(tmp_path / "data.json", bad))
    bad = rows(2)
    bad[0]["length"] = "huge"
    with pytest.raises(InputError, match=r"row 1: field 'length' is 'huge'; allowed: short, medium, long"):
        read_rows(write_json(tmp_path / "data.json", bad))
    bad = rows(2)
    del bad[1]["choice_C"]
    with pytest.raises(InputError, match=r"row 2: missing field 'choice_C'"):
        read_rows(write_json(tmp_path / "data.json", bad))
    dup = rows(2)
    dup[1]["_id"] = "q0"
    with pytest.raises(InputError, match=r"row 2: duplicate _id 'q0' \(first at .*row 1\)"):
        read_rows(write_json(tmp_path / "data.json", dup))


def test_hub_download_offline_and_refused(tmp_path, monkeypatch):
    import huggingface_hub
    from eval.longbench_v2 import data
    local = write_json(tmp_path / "data.json", rows(1))
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: calls.append((a, k)) or str(local))
    assert data.data_path(None, "abc123") == local
    assert calls == [(("THUDM/LongBench-v2", "data.json"), {"repo_type": "dataset", "revision": "abc123"})]

    class ConnectError(Exception):
        pass

    def offline(*args, **kwargs):
        raise ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(InputError, match="offline.*longbench_v2.data_file=FILE"):
        data.data_path(None, "main")

    def refused(*args, **kwargs):
        raise FileNotFoundError("Revision Not Found for url ... nope")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(InputError, match="longbench_v2.revision='nope': the hub refused") as info:
        data.data_path(None, "nope")
    assert "offline" not in str(info.value)


# --- the app --------------------------------------------------------------------------------------

def run_app(tmp_path, *extra):
    from eval.longbench_v2.__main__ import run
    cfg = compose("longbench_v2", ["model=tiny-llama", "compressor.budget=64", "compressor.window=8",
                                   f"longbench_v2.data_file={tmp_path}/data.json", "longbench_v2.max_new_tokens=3",
                                   f"output_dir={tmp_path}/run", *extra])
    return run(cfg)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


OFFICIAL_FIELDS = ["_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B",
                   "choice_C", "choice_D", "answer", "context"]


def test_app_predicts_resumes_and_scores(tmp_path):
    write_json(tmp_path / "data.json", rows(3))
    scores = run_app(tmp_path)
    pred = tmp_path / "run" / "pred" / "0shot.jsonl"
    records = lines(pred)
    assert [r["_id"] for r in records] == ["q0", "q1", "q2"]
    assert list(records[0])[:15] == OFFICIAL_FIELDS + ["response", "pred", "judge"]  # pred.py's order
    assert records[0]["context"] == rows(1)[0]["context"][:1000]
    for r in records:
        assert r["pred"] == extract_answer(r["response"]) and r["judge"] == (r["pred"] == r["answer"])
        assert r["input_tokens"] > 0 and r["truncated"] is False
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "scores.json").read_text()) == scores
    official = official_result(run_dir / "pred")
    assert (run_dir / "result.txt").read_text() == official
    assert json.loads((run_dir / "summary.json").read_text())["0shot"] == {
        "rows": 3, "scored": 3, "oom": 0, "no_answer": sum(r["pred"] is None for r in records), "dataset_rows": 3}
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["longbench_v2.data_source"] == str(tmp_path / "data.json")
    # a crash after the second record, in the middle of writing the third
    pred.write_text("".join(json.dumps(r) + "\n" for r in records[:2]) + '{"_id": "q2", "resp')
    run_app(tmp_path)
    again = lines(pred)
    assert [r["_id"] for r in again] == ["q0", "q1", "q2"]
    assert {**again[2], "cost": None} == {**records[2], "cost": None}  # greedy: the same answer, its cost anew
    run_app(tmp_path)  # nothing left to do
    assert [r["_id"] for r in lines(pred)] == ["q0", "q1", "q2"]


def test_app_cot_runs_two_passes(tmp_path, monkeypatch):
    from eval.runner import Runner
    write_json(tmp_path / "data.json", rows(2))
    real, lengths = Runner.generate, []

    def watch(self, ids, compressor, max_new_tokens, **kwargs):
        lengths.append((ids.shape[1], max_new_tokens))
        return real(self, ids, compressor, max_new_tokens, **kwargs)

    monkeypatch.setattr(Runner, "generate", watch)
    run_app(tmp_path, "longbench_v2.cot=true", "longbench_v2.cot_max_new_tokens=5", "longbench_v2.max_length=400")
    records = lines(tmp_path / "run" / "pred" / "0shot_cot.jsonl")
    assert not (tmp_path / "run" / "pred" / "0shot.jsonl").exists()
    assert list(records[0])[:16] == OFFICIAL_FIELDS + ["response_cot", "response", "pred", "judge"]
    assert [n for _, n in lengths] == [5, 3, 5, 3]  # reasoning, then the answer, per question
    assert [(r["input_tokens"], r["answer_input_tokens"]) for r in records] == [(lengths[0][0], lengths[1][0]),
                                                                              (lengths[2][0], lengths[3][0])]
    assert records[0]["truncated"] is True and lengths[0][0] == 400 and lengths[1][0] < 400
    assert set(json.loads((tmp_path / "run" / "scores.json").read_text())) == {"0shot_cot"}
    # cot only picks the prediction file: the zero-shot run resumes the same folder beside it
    run_app(tmp_path, "longbench_v2.cot_max_new_tokens=5", "longbench_v2.max_length=400")
    assert [r["_id"] for r in lines(tmp_path / "run" / "pred" / "0shot.jsonl")] == ["q0", "q1"]
    assert set(json.loads((tmp_path / "run" / "scores.json").read_text())) == {"0shot", "0shot_cot"}


def test_query_agnostic_runs_append_the_question_part_in_both_cot_passes(tmp_path, monkeypatch):
    """query_aware=false: each pass gets its prompt's question_tokens; with full KV the answers are
    the same as query-aware ones (the split only moves the question to a second forward pass)."""
    from eval.longbench_v2.__main__ import run
    from eval.runner import Runner
    write_json(tmp_path / "data.json", rows(2))
    real, seen = Runner.generate, []

    def watch(self, ids, compressor, max_new_tokens, **kwargs):
        seen.append((ids.shape[1], kwargs.get("question_tokens", 0)))
        return real(self, ids, compressor, max_new_tokens, **kwargs)

    monkeypatch.setattr(Runner, "generate", watch)
    records = {}
    for aware in (True, False):
        seen.clear()
        cfg = compose("longbench_v2", ["model=tiny-llama", "compressor=full", f"query_aware={str(aware).lower()}",
                                       f"longbench_v2.data_file={tmp_path}/data.json", "longbench_v2.cot=true",
                                       "longbench_v2.max_new_tokens=3", "longbench_v2.cot_max_new_tokens=4",
                                       f"output_dir={tmp_path}/run-{aware}"])
        run(cfg)
        records[aware] = lines(tmp_path / f"run-{aware}" / "pred" / "0shot_cot.jsonl")
        if aware:
            assert all(q == 0 for _, q in seen)
        else:
            assert len(seen) == 4 and all(0 < q < n for n, q in seen)
            assert json.loads((tmp_path / "run-False" / "settings.json").read_text())["query_aware"] is False
    for a, b in zip(records[True], records[False]):
        assert (a["response_cot"], a["response"]) == (b["response_cot"], b["response"])


def test_out_of_memory_is_recorded_and_retried_on_request(tmp_path, monkeypatch):
    from eval.runner import Runner
    write_json(tmp_path / "data.json", rows(3))
    real = Runner.generate

    def flaky(self, ids, *args, **kwargs):
        flaky.calls += 1
        if flaky.calls == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(self, ids, *args, **kwargs)

    flaky.calls = 0
    monkeypatch.setattr(Runner, "generate", flaky)
    run_app(tmp_path)
    pred = tmp_path / "run" / "pred" / "0shot.jsonl"
    records = lines(pred)
    assert [r.get("oom", False) for r in records] == [False, True, False]
    assert records[1]["pred"] is None and records[1]["judge"] is False and records[1]["response"] == ""
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["0shot"]
    assert (summary["rows"], summary["scored"], summary["oom"]) == (3, 2, 1)
    monkeypatch.setattr(Runner, "generate", real)
    run_app(tmp_path)  # resuming does not retry it by default
    assert sum(bool(r.get("oom")) for r in lines(pred)) == 1
    run_app(tmp_path, "longbench_v2.retry_oom=true")
    records = lines(pred)
    assert sorted(r["_id"] for r in records) == ["q0", "q1", "q2"] and not any(r.get("oom") for r in records)


def test_the_fingerprint_knows_the_task():
    """eval.settings lists the section: limit, retry_oom and cot cannot change a record (cot picks the
    file), data_file and revision count as longbench_v2.data_source."""
    from eval.longbench_v2.predict import task_settings
    from eval.settings import DERIVED, HARMLESS, TASK_SECTIONS, fingerprint
    assert "longbench_v2" in TASK_SECTIONS
    assert set(HARMLESS["longbench_v2"]) == {"limit", "retry_oom", "cot"}
    assert set(DERIVED["longbench_v2"]) == {"data_file", "revision"}
    cfg = compose("longbench_v2", ["output_dir=/tmp/unused"])
    settings = fingerprint(cfg, task_settings(cfg))
    assert settings["longbench_v2.data_source"] == "hub:THUDM/LongBench-v2@main"
    assert "longbench_v2" not in settings and "longbench_v2.cot" not in settings
    assert settings["longbench_v2.max_length"] == 120000


def test_max_length_is_at_most_the_models(tmp_path):
    from eval.longbench_v2.predict import max_length
    assert max_length(compose("longbench_v2", ["model=tiny-llama"])) == 4000
    assert max_length(compose("longbench_v2", ["model=llama-3.1-8b-instruct"])) == 120000
    assert max_length(compose("longbench_v2", ["model=tiny-llama", "longbench_v2.max_length=300"])) == 300
    cfg = compose("longbench_v2", ["model=llama-3.1-8b-instruct", "longbench_v2.max_length=null"])
    assert max_length(cfg) == 127500


@pytest.mark.parametrize("override,message", [
    ("longbench_v2.limit=0", r"longbench_v2.limit=0 must be a positive integer"),
    ("longbench_v2.max_length=-5", r"longbench_v2.max_length=-5 must be a positive integer"),
    ("longbench_v2.data_file=/nonexistent/data.json", r"longbench_v2.data_file=/nonexistent/data.json: no such file"),
])
def test_app_bad_input_errors(tmp_path, override, message):
    write_json(tmp_path / "data.json", rows(1))
    with pytest.raises(InputError, match=message) as info:
        run_app(tmp_path, override)
    assert "\n" not in str(info.value)


def test_changed_data_under_existing_predictions_is_refused(tmp_path):
    write_json(tmp_path / "data.json", rows(1))
    run_app(tmp_path)
    changed = rows(1)
    changed[0]["answer"] = "D"
    write_json(tmp_path / "data.json", changed)
    with pytest.raises(InputError, match="longbench_v2.data_file: the data changed under existing predictions"):
        run_app(tmp_path)


def test_cli_exits_nonzero_with_one_line(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "eval.longbench_v2", "longbench_v2.limit=0", f"output_dir={tmp_path}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: longbench_v2.limit=0 must be a positive integer (or null)"
