"""DuoAttention (``snapkv/methods/duo_attention.py``) against kvpress 0.5.5's ``DuoAttentionPress`` on local data:
the head scores computed on the fly equal kvpress's from the same texts, the streaming heads' slots are freed
(kvpress masks them), bad input is one line, a shared prefill equals each setting alone. The kept positions and
tokens of both registry entries are in the generic parity test (``tests/test_kvpress_parity.py``, fixture
``tests/fixtures/kvpress/entries/duo_attention.json.gz``, written by ``entries/write_duo_attention.py``)."""
from __future__ import annotations

import gzip
import json
import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BatchEncoding, DynamicCache

import snapkv
import snapkv.methods.duo_attention as duo
from snapkv.hooks import Replay
from eval.runner import kv_cache_bytes
from snapkv.ragged import storage_alternatives
from test_kvpress_parity import FIXTURES, check, run_cases
from tiny_models import tiny_model

DATA = FIXTURES / "duo_attention"
RECORD = json.loads(gzip.open(FIXTURES / "entries" / "duo_attention.json.gz", "rt", encoding="utf-8").read())
TEXTS = "tests/fixtures/kvpress/duo_attention/texts.jsonl"
TINY_PATTERNS = "tests/fixtures/kvpress/duo_attention/patterns_tiny_gqa"
SMOL_PATTERNS = "tests/fixtures/kvpress/duo_attention/patterns_smollm2"


class ToyTokenizer:
    """The writer's stand-in tokenizer for the tiny model (``RECORD["toy_tokenizer"]``): a text's first 200 UTF-8
    bytes, each modulo 64."""

    name_or_path = "toy-bytes-mod-64"

    def __call__(self, text, return_tensors="pt"):
        return BatchEncoding({"input_ids": torch.tensor([[byte % 64 for byte in text.encode("utf-8")[:200]]])})


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent.parent.parent)  # the fixture's paths are the repository's


def tiny():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def our_scores(model, tokenizer) -> np.ndarray:
    texts, _ = duo.read_texts(TEXTS)
    base = getattr(model, "base_model", model)
    replay = Replay(model, list(base.layers), base, lambda: tokenizer)
    return duo.on_the_fly_scores(replay, duo.sampled(texts))


def same_heads(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    for ratio in (0.25, 0.5, 0.75, 0.875):  # the streaming heads kvpress chooses from its scores
        assert torch.equal(duo.streaming_heads(ours, ratio), duo.streaming_heads(theirs, ratio)), ratio


def test_the_texts_are_sampled_as_pandas_samples_booksum():
    texts, _ = duo.read_texts(TEXTS)
    assert len(texts) == 60 and len(duo.sampled(texts)) == 50
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"chapter": texts})
    assert duo.sampled(texts) == frame.sample(50, random_state=42)["chapter"].tolist()
    assert sorted(duo.sampled(texts[:7])) == sorted(texts[:7])  # fewer than 50: every text


def test_head_scores_on_the_fly_equal_kvpress_on_the_tiny_model():
    with torch.no_grad():
        ours = our_scores(tiny(), ToyTokenizer())
    same_heads(ours, np.array(RECORD["head_scores"]["tiny_gqa_on_the_fly"], dtype=np.float32))


@pytest.mark.slow
def test_head_scores_on_the_fly_equal_kvpress_on_smollm2(smollm2):
    model, tokenizer = smollm2
    with torch.no_grad():
        ours = our_scores(model, tokenizer)
    same_heads(ours, np.array(RECORD["head_scores"]["smollm2_on_the_fly"], dtype=np.float32))


def test_the_tiny_models_on_the_fly_cases_keep_what_kvpress_keeps():
    """With the stand-in tokenizer (the tiny model has none): 300 tokens are within sink 128 + recent 256, so every
    head keeps every position in kvpress too; the tokens are full KV's."""
    record = RECORD["tiny_on_the_fly"]
    assert check(run_cases(tiny(), record, tokenizer=ToyTokenizer()), len(record["ids"])) == len(record["cases"]) == 4


def test_both_entries_are_in_the_fixture():
    kinds = {(name, bool(case["ours"].get("on_the_fly_scoring"))) for name, model in RECORD["models"].items()
             for case in model["cases"]}
    assert kinds == {("smollm2", False), ("smollm2", True), ("tiny_gqa", False)}
    assert all(case["ours"]["head_ratio"] == case["ratio"] for model in RECORD["models"].values()
               for case in model["cases"])


def prefill(model, cfgs, ids, **kw):
    """Each setting's cache bytes (held, and kvpress's alternatives), the first setting's tokens per layer, each
    cache's kept positions, and its logits for one more token (decoded inside the session, as a compressed cache is)."""
    with torch.no_grad(), snapkv.compress(model, cfgs, **kw) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        caches, lengths = session.caches, session.cache_lengths
        kept = [snapkv.kept_positions(cache) for cache in caches]
        stored = [(kv_cache_bytes(cache), storage_alternatives(cache, ids.shape[1])) for cache in caches]
        logits = [model(torch.tensor([[7]]), cache=cache).logits for cache in caches]
        return stored, lengths, kept, logits


def test_streaming_heads_free_their_slots():
    """kvpress keeps every key and masks the streaming heads' middle (its cache is full KV's, ``masked_kv_bytes``);
    here each streaming head stores its sink and recent tokens only: the bytes removed are kvpress's own
    ``compression_ratio_`` of full KV's."""
    model = tiny()
    ids = torch.tensor([RECORD["models"]["tiny_gqa"]["ids"]])
    length = ids.shape[1]
    cfg = snapkv.DuoAttention(patterns=TINY_PATTERNS, head_ratio=0.5)
    ((stored, alternatives),), lengths, (kept,), _ = prefill(model, [cfg], ids)
    sink, recent = cfg.sizes()
    assert (sink, recent) == (16, 64)  # the pattern folder's config.json
    streaming = cfg._streaming
    assert int(streaming.sum()) == 2
    full = 2 * 2 * 2 * length * 8 * 4  # keys and values, 2 layers x 2 KV heads x 300 x head_dim 8, float32
    for layer, rows in enumerate(kept):
        for head, positions in enumerate(rows[0]):
            want = list(range(sink)) + list(range(length - recent, length)) if streaming[layer, head] \
                else list(range(length))
            assert positions.tolist() == want
        assert lengths[layer] == round(sum(len(p) for p in rows[0]) / 2)
    assert stored == sum(len(p) for rows in kept for p in rows[0]) * 8 * 4 * 2
    assert alternatives["masked_kv_bytes"] == full  # kvpress's: every key kept, the middle masked
    compression_ratio = float(streaming.float().mean()) * (1 - (sink + recent) / length)  # kvpress's compression_ratio_
    assert stored / full == pytest.approx(1 - compression_ratio)


def test_a_shared_prefill_equals_each_setting_alone():
    model = tiny()
    ids = torch.tensor([RECORD["models"]["tiny_gqa"]["ids"]])
    settings = [snapkv.DuoAttention(patterns=TINY_PATTERNS, head_ratio=0.25),
                snapkv.DuoAttention(patterns=TINY_PATTERNS, head_ratio=0.75, sink_size=4, recent_size=32),
                snapkv.SnapKV(budget=64, window=8), snapkv.AdaKV(budget=64, window=8)]
    _, _, kept, logits = prefill(model, settings, ids)
    for cfg, shared, shared_logits in zip(settings, kept, logits):
        _, _, (alone,), (alone_logits,) = prefill(model, [cfg], ids)
        for ours, solo in zip(shared, alone):
            assert all(torch.equal(a, b) for a, b in zip(ours[0], solo[0]))
        assert torch.equal(shared_logits, alone_logits), cfg.label()


def test_the_scores_on_the_fly_are_computed_once_per_model_and_texts(monkeypatch):
    calls = []
    real = duo.on_the_fly_scores
    monkeypatch.setattr(duo, "on_the_fly_scores", lambda replay, texts: calls.append(1) or real(replay, texts))
    monkeypatch.setattr(duo, "_ON_THE_FLY", weakref.WeakKeyDictionary())
    model = tiny_model("qwen3")  # queries and keys normalised per head (q_norm, k_norm), as kvpress scores Qwen3
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    settings = [snapkv.DuoAttention(on_the_fly_scoring=True, on_the_fly_text=TEXTS, head_ratio=r)
                for r in (0.25, 0.5)]
    for _ in range(2):  # two prompts, two sessions, two settings: one computation
        _, _, kept, _ = prefill(model, settings, ids, tokenizer=ToyTokenizer())
    assert len(calls) == 1
    assert [int(cfg._streaming.sum()) for cfg in settings] == [round(6 * 0.25), 3]  # 3 layers x 2 KV heads
    assert sum(len(p) for layer in kept[1] for p in layer[0]) == 3 * 500 + 3 * (128 + 256)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("fields, field", [
    (dict(head_ratio=1.5), "head_ratio"),
    (dict(on_the_fly_scoring=True, patterns=TINY_PATTERNS), "patterns"),
    (dict(on_the_fly_text=TEXTS), "on_the_fly_text"),
    (dict(recent_size=0), "recent_size"),
    (dict(patterns=3), "patterns"),
])
def test_bad_settings_are_one_line_naming_the_field(fields, field):
    with pytest.raises(snapkv.InputError) as error:
        snapkv.DuoAttention(**fields)
    assert one_line(error).startswith(f"{field}=")


def broken_folder(tmp_path, config=None, tsv=None) -> str:
    folder = tmp_path / "patterns"
    shutil.copytree(DATA / "patterns_tiny_gqa", folder)
    if config is not None:
        (folder / "config.json").write_text(config)
    if tsv is not None:
        (folder / "full_attention_heads.tsv").write_text(tsv)
    return str(folder)


@pytest.mark.parametrize("case, words", [
    ("no path", "patterns=None"),
    ("missing folder", "not a folder"),
    ("no tsv", "full_attention_heads.tsv is missing"),
    ("unreadable tsv", "unreadable"),
    ("config without sizes", "sink_size"),
    ("smollm2's pattern", "30 x 3 head scores, but the model has 2 layers x 2 KV heads"),
    ("no texts", "does not exist"),
    ("no tokenizer", "needs the model's tokenizer"),
])
def test_bad_input_is_one_line_naming_the_field(tmp_path, case, words):
    fields = {
        "no path": lambda: {},
        "missing folder": lambda: dict(patterns=str(tmp_path / "nowhere")),
        "no tsv": lambda: dict(patterns=broken_folder(tmp_path)),
        "unreadable tsv": lambda: dict(patterns=broken_folder(tmp_path, tsv="0.1\tzero\n0.3\t0.4\n")),
        "config without sizes": lambda: dict(patterns=broken_folder(tmp_path, config='{"sink_size": 4}')),
        "smollm2's pattern": lambda: dict(patterns=SMOL_PATTERNS),
        "no texts": lambda: dict(on_the_fly_scoring=True, on_the_fly_text=str(tmp_path / "none.jsonl")),
        "no tokenizer": lambda: dict(on_the_fly_scoring=True, on_the_fly_text=TEXTS),
    }[case]()
    if case == "no tsv":
        (Path(fields["patterns"]) / "full_attention_heads.tsv").unlink()
    cfg = snapkv.DuoAttention(**fields)
    with pytest.raises(snapkv.InputError) as error:
        prefill(tiny(), [cfg], torch.tensor([RECORD["models"]["tiny_gqa"]["ids"]]))
    message = one_line(error)
    field = "on_the_fly" if cfg.on_the_fly_scoring else "patterns"
    assert message.startswith(field) and words in message, message


def test_the_planner_plans_what_the_heads_keep():
    """Before the heads are known the planner takes ``head_ratio`` in every layer; with the pattern read (``prepare``)
    each layer's mean: what the cache records."""
    model = tiny()
    ids = torch.tensor([RECORD["models"]["tiny_gqa"]["ids"]])
    cfg = snapkv.DuoAttention(patterns=TINY_PATTERNS, head_ratio=0.75)
    assert [cfg.stored_tokens(i, 2, 300, 2) for i in range(2)] == [round(300 - 0.75 * (300 - 80))] * 2
    _, lengths, _, _ = prefill(model, [cfg], ids)
    assert [cfg.stored_tokens(i, 2, 300, 2) for i in range(2)] == lengths
    assert cfg.layer_budget(0, 2, 80) == 80 and cfg.recent_window(0, 2, 80) == 0  # within sink + recent: kept whole
