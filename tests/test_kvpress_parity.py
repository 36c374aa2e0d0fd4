"""Every leaderboard method keeps what kvpress 0.5.5's press keeps, on cases kvpress itself wrote
(``tests/fixtures/kvpress``: its README gives the commands): per (layer, KV head), the set of kept prompt
positions, and the 8 greedy tokens decoded from the compressed cache (AdaKV's: kvpress masks what it
evicts, we store only what is kept); for a case recording ``channels`` (ThinK), the set of key channels each
(layer, KV head) keeps (kvpress zeroes the others, we store only the kept ones). kvpress wrote every fixture of a
model on one prompt, so all their settings share one prefill here.

A (layer, head) pair may differ from kvpress's only by a tie at the cut (``tests/parity.py``: the positions'
scores, as we compute them, within a stated tolerance of the cut; counted and reported at the end of the run),
never otherwise; the tokens are compared exactly.

``cases.json.gz`` holds the first entries; each entry added since has its own file,
``entries/<name>.json.gz``, written by ``entries/write_<name>.py``, whose cases carry our setting
(``ours``), so a new entry is its method's file and its fixture, not an edit here."""
from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import snapkv
from parity import compare_kept, kept_array
from snapkv.prefill import PREFILL_CHUNK

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kvpress"
CASES = json.loads(gzip.open(FIXTURES / "cases.json.gz", "rt", encoding="utf-8").read())
# kvpress's SnapKVPress defaults; the other presses' defaults are our methods' defaults
KVPRESS_SETTINGS = {"snapkv": dict(window=64, kernel=5, pooling="avgpool", gqa="mean")}
# kvpress presses that are one of our methods with other fields (the leaderboard's entries)
ENTRIES = {"adakv_expected_attention": ("adakv", dict(scorer="expected_attention", scorer_epsilon=0.01))}


ENTRY_FILES = sorted((FIXTURES / "entries").glob("*.json.gz"))


def setting(case) -> snapkv.Method:
    if "ours" in case:
        ours = dict(case["ours"])
        return snapkv.build_config(ours.pop("method"), budget=None, ratio=case["ratio"], **ours)
    name = case["method"]
    method, fields = ENTRIES.get(name, (name, KVPRESS_SETTINGS.get(name, {})))
    return snapkv.build_config(method, budget=None, ratio=case["ratio"], **fields)


def kvpress_kept(case, field: str = "kept", shape_field: str = "shape") -> np.ndarray:
    shape = case[shape_field]
    bits = np.unpackbits(np.frombuffer(base64.b64decode(case[field]), np.uint8))[:int(np.prod(shape))]
    return bits.reshape(shape).astype(bool)


def our_channels(cache, shape) -> np.ndarray:
    """``[layers, KV heads, head_dim]``: the key channels each head of the first row keeps."""
    from snapkv.channels import kept_channels
    kept = np.zeros(shape, dtype=bool)
    for layer, rows in enumerate(kept_channels(cache)):
        for head, channels in enumerate(rows[0]):
            kept[layer, head, channels.numpy()] = True
    return kept


def our_kept(cache, shape) -> np.ndarray:
    kept = kept_array(cache, shape[-1])
    assert kept.shape == tuple(shape), (kept.shape, shape)
    return kept


def floored_by_our_window(case, length: int) -> bool:
    """kvpress's SnapKV keeps ``int(n * (1 - ratio))`` even when that is less than its window (then an
    arbitrary part of the tied window); ours keeps at least the window and one more (docs/leaderboard.md)."""
    window = KVPRESS_SETTINGS.get(case["method"], {}).get("window")
    return window is not None and max(1, int(length * (1 - case["ratio"]))) < window + 1


def run_cases(model, record, tokenizer=None, prefill_chunk=PREFILL_CHUNK):
    ids = torch.tensor([record["ids"]])
    cases = record["cases"]
    outcomes = []
    # a case whose method reads the question's length (FINCH) records it: the prompt's last tokens
    questions = {c["question_tokens"] for c in cases if "question_tokens" in c}
    assert len(questions) <= 1, "the cases of one prefill share one question length"
    question = questions.pop() if questions else None
    with torch.no_grad(), snapkv.compress(model, [setting(c) for c in cases], question_tokens=question,
                                          tokenizer=tokenizer, record_scores=True,
                                          prefill_chunk=prefill_chunk) as session:
        out = model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        caches, session.caches = session.caches, []
        first = int(out.logits[0, -1].argmax())
        for case, cache in zip(cases, caches):
            want = kvpress_kept(case)
            got = our_kept(cache, want.shape)
            tokens = [first]
            for _ in range(len(case["tokens"]) - 1):
                tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1].argmax()))
            comparison = compare_kept(got, want, snapkv.ranking_scores(cache),
                                      label=f"kvpress {setting(case).label()}")
            if "channels" in case:  # fewer key channels (ThinK): a head is equal when its channels are too
                channels = kvpress_kept(case, "channels", "channel_shape")
                ours = our_channels(cache, channels.shape)
                comparison.differing += [(layer, head, "other key channels") for layer, head in
                                         zip(*np.nonzero(~(ours == channels).all(axis=-1)))]
            outcomes.append((case, got, want, comparison, tokens))
    return outcomes


def check(outcomes, length: int):
    compared = 0
    for case, got, _, comparison, tokens in outcomes:
        label = f"{case['method']} ratio {case['ratio']}"
        if floored_by_our_window(case, length):
            assert (got.sum(-1) == KVPRESS_SETTINGS[case["method"]]["window"] + 1).all(), label
            continue
        assert comparison.equal, comparison.describe(label)
        assert tokens == case["tokens"], label
        compared += 1
    return compared


def load_tiny_gqa():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def test_tiny_gqa_model_keeps_what_kvpress_keeps(tiny_gqa_outcomes):
    record = CASES["models"]["tiny_gqa"]
    compared = check(tiny_gqa_outcomes["cases"], len(record["ids"]))
    assert compared == len(record["cases"]) - 1  # SnapKV at 0.875 keeps 37 of a 64-token window in kvpress
    assert "kvzip" not in {case["method"] for case in record["cases"]}  # it needs a tokenizer: SmolLM2 only


def test_tiny_gqa_model_keeps_what_kvpress_keeps_with_a_chunked_prefill(tiny_gqa_chunked_outcomes):
    record = CASES["models"]["tiny_gqa"]
    assert check(tiny_gqa_chunked_outcomes["cases"], len(record["ids"])) == len(record["cases"]) - 1


def _entry_cases(path: Path, model_name: str):
    record = json.loads(gzip.open(path, "rt", encoding="utf-8").read())
    return record["models"].get(model_name)


def every_case_from_one_prefill(model, model_name: str, prefill_chunk=PREFILL_CHUNK) -> dict:
    """name -> the outcomes of that fixture's cases on ``model_name`` (``cases`` for ``cases.json.gz``, else the
    entry's name), every case of every fixture decoded from one shared prefill: kvpress wrote them all on one
    prompt per model."""
    records = {"cases": CASES["models"][model_name]}
    for path in ENTRY_FILES:
        record = _entry_cases(path, model_name)
        if record is not None:
            records[path.name.split(".")[0]] = record
    prompts = {tuple(record["ids"]) for record in records.values()}
    assert len(prompts) == 1, f"the {model_name} fixtures hold {len(prompts)} prompts; one prefill needs one"
    every_case = [case for record in records.values() for case in record["cases"]]
    merged = {"ids": records["cases"]["ids"], "cases": every_case}
    outcomes = iter(run_cases(model, merged, prefill_chunk=prefill_chunk))
    return {name: [next(outcomes) for _ in record["cases"]] for name, record in records.items()}


@pytest.fixture(scope="session")  # make test runs a file on one worker (--dist loadfile): one prefill a model
def smollm2_outcomes(smollm2):
    return every_case_from_one_prefill(smollm2[0], "smollm2")


@pytest.fixture(scope="session")
def tiny_gqa_outcomes():
    return every_case_from_one_prefill(load_tiny_gqa(), "tiny_gqa")


# the fixtures' 300-token prompt prefilled in chunks of 64 (``snapkv.prefill``; the default chunk takes it whole)
@pytest.fixture(scope="session")
def tiny_gqa_chunked_outcomes():
    return every_case_from_one_prefill(load_tiny_gqa(), "tiny_gqa", prefill_chunk=64)


@pytest.mark.slow
def test_smollm2_keeps_what_kvpress_keeps(smollm2_outcomes):
    record = CASES["models"]["smollm2"]
    compared = check(smollm2_outcomes["cases"], len(record["ids"]))
    methods = {case["method"] for case in record["cases"]}
    assert compared == len(record["cases"]) == 4 * len(methods)
    assert methods == {"knorm", "tova", "keydiff", "expected_attention", "snapkv", "adakv", "critical_adakv",
                       "streamingllm", "adakv_expected_attention", "kvzip"}


def _check_entry(path: Path, outcomes: dict, model_name: str) -> None:
    name, model_record = path.name.split(".")[0], _entry_cases(path, model_name)
    if model_record is None:
        pytest.skip(f"{path.name} has no cases on this model")
    compared = check(outcomes[name], len(model_record["ids"]))
    assert compared == len(model_record["cases"]) > 0, path.name


ENTRY_IDS = [p.name.split(".")[0] for p in ENTRY_FILES]


@pytest.mark.parametrize("path", ENTRY_FILES, ids=ENTRY_IDS)
def test_each_added_entry_keeps_what_kvpress_keeps_on_the_tiny_model(path, tiny_gqa_outcomes):
    _check_entry(path, tiny_gqa_outcomes, "tiny_gqa")


@pytest.mark.parametrize("path", ENTRY_FILES, ids=ENTRY_IDS)
def test_each_added_entry_keeps_what_kvpress_keeps_with_a_chunked_prefill(path, tiny_gqa_chunked_outcomes):
    _check_entry(path, tiny_gqa_chunked_outcomes, "tiny_gqa")


@pytest.mark.slow
@pytest.mark.parametrize("path", ENTRY_FILES, ids=ENTRY_IDS)
def test_each_added_entry_keeps_what_kvpress_keeps_on_smollm2(path, smollm2_outcomes):
    _check_entry(path, smollm2_outcomes, "smollm2")
