"""Compression while decoding equals kvpress 0.5.5's ``DecodingPress`` family on cases kvpress itself wrote
(``tests/fixtures/kvpress/decoding/write_decoding.py``, its docstring gives the command): after a long greedy
generation crossing at least three cuts, the positions every (layer, KV head) holds and every generated token. A
(layer, head) may hold other positions than kvpress's only where one of our cuts met a tie (``tests/parity.py``).
The registry's ``decoding_knorm``, ``decoding_streaming_llm``, ``decoding_tova`` and ``decoding_keydiff``, plus
``PrefillDecodingPress`` (Knorm on the prompt and while decoding) and ``CompressionRatioDecodingPress``. All the
settings of a model share one prefill here; each cache then decodes on its own.

kvpress's head-adaptive entries (``decoding_adakv_snapkv``, ``decoding_adakv_expected_attention_e2``; cases by
``write_decoding_adakv.py``) mask what they evict, so a masked position can come back at a later cut with its key
overwritten; ours evict. Pinned: the first cut's kept positions per (layer, KV head), every token up to the second
cut, the number of cuts (``docs/decoding.md`` gives how much agrees at the end)."""
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
from parity import compare_held
from snapkv.cache_state import state_of

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kvpress"
RECORD = json.loads(gzip.open(FIXTURES / "decoding" / "decoding.json.gz", "rt", encoding="utf-8").read())


def unpacked(bits: str, shape) -> np.ndarray:
    flat = np.unpackbits(np.frombuffer(base64.b64decode(bits), np.uint8))[:int(np.prod(shape))]
    return flat.reshape(shape).astype(bool)


def kvpress_held(case) -> np.ndarray:
    return unpacked(case["kept"], case["shape"])


def our_held(cache, shape) -> np.ndarray:
    """Which positions each (layer, KV head) holds: what its last cut kept and every token appended since."""
    state = state_of(cache)
    held = np.zeros(shape, dtype=bool)
    for layer, rows in enumerate(snapkv.kept_positions(cache)):
        for head, positions in enumerate(rows[0]):
            held[layer, head, positions.numpy()] = True
        held[layer, :, state.prompt_length:state.consumed] = True
    return held


def after_one_prefill(model, record):
    """Every case's setting from one shared prefill of the record's prompt: yields ``(case, its cache, the first
    token)``, the session open (and gradients off) while the caller decodes."""
    settings = [snapkv.build_config(**case["ours"]) for case in record["cases"]]
    with torch.no_grad(), snapkv.compress(model, settings, record_scores=True) as session:
        out = model(torch.tensor([record["ids"]]), cache=DynamicCache(config=model.config), use_cache=True,
                    logits_to_keep=1)
        caches, session.caches = session.caches, []
        first = int(out.logits[0, -1].argmax())
        yield from ((case, cache, first) for case, cache in zip(record["cases"], caches))


def next_token(model, cache, token: int) -> int:
    return int(model(torch.tensor([[token]]), cache=cache).logits[0, -1].argmax())


def run(model, record):
    outcomes = []
    for case, cache, first in after_one_prefill(model, record):
        tokens = [first]
        for _ in range(len(case["tokens"]) - 1):
            tokens.append(next_token(model, cache, tokens[-1]))
        want = kvpress_held(case)
        got = our_held(cache, want.shape)
        comparison = compare_held(got, want, snapkv.decoding_rankings(cache), label=f"kvpress {case['entry']}")
        outcomes.append((case, comparison, tokens, state_of(cache).decoding_cuts))
    return outcomes


def check(record, layers: int) -> int:
    for case, comparison, tokens, cuts in record:
        prefill_cuts = layers if case["ours"]["ratio"] else 0  # kvpress's count has its prefill's too
        assert cuts == case["cuts"] - prefill_cuts, f"{case['entry']}: {cuts} layer cuts, kvpress {case['cuts']}"
        assert comparison.equal, comparison.describe(case["entry"])
        assert tokens == case["tokens"], f"{case['entry']}: the generated tokens differ"
    return len(record)


def test_the_fixture_crosses_three_cuts_and_names_every_weightless_entry():
    for record in RECORD["models"].values():
        assert (record["tokens"] - 1) // record["interval"] >= 3
        entries = {case["entry"] for case in record["cases"]}
        assert {"decoding_knorm", "decoding_streaming_llm", "decoding_tova", "decoding_keydiff"} <= entries
        # the generations differ between methods: the cuts change what the model writes
        assert len({tuple(case["tokens"]) for case in record["cases"]}) > 1


def test_tiny_gqa_model_decodes_as_kvpress_decodes():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    assert check(run(model, RECORD["models"]["tiny_gqa"]), 2) == 6


@pytest.mark.slow
def test_smollm2_decodes_as_kvpress_decodes(smollm2):
    assert check(run(smollm2[0], RECORD["models"]["smollm2"]), 30) == 6


# kvpress's head-adaptive entries mask instead of evicting (``snapkv.decoding_cuts``): equal up to the second cut
ADAKV_RECORD = json.loads(gzip.open(FIXTURES / "decoding" / "decoding_adakv.json.gz", "rt", encoding="utf-8").read())


def run_head_adaptive(model, record):
    """Per case: (layers whose every head holds kvpress's first cut, layers, our tokens and kvpress's up to its
    second cut, our cuts)."""
    outcomes = []
    for case, cache, first in after_one_prefill(model, record):
        first_cut, second = case["cut_passes"][0], case["cut_passes"][1]
        want_first = unpacked(case["first_cut"], case["first_cut_shape"])
        tokens, equal_layers = [first], None
        for passed in range(len(case["tokens"]) - 1):
            tokens.append(next_token(model, cache, tokens[-1]))
            if passed == first_cut:
                got_first = np.zeros(want_first.shape, dtype=bool)
                for layer, rows in enumerate(snapkv.kept_positions(cache)):
                    for head, positions in enumerate(rows[0]):
                        got_first[layer, head, positions.numpy()] = True
                equal_layers = int((got_first == want_first).all(axis=(1, 2)).sum())
        outcomes.append((case, equal_layers, want_first.shape[0], tokens[:second + 2], case["tokens"][:second + 2],
                         state_of(cache).decoding_cuts))
    return outcomes


def check_head_adaptive(outcomes) -> int:
    for case, equal_layers, layers, ours, theirs, cuts in outcomes:
        assert cuts == case["cuts"], f"{case['entry']}: {cuts} layer cuts, kvpress {case['cuts']}"
        assert equal_layers == layers, f"{case['entry']}: {layers - equal_layers} layers kept other positions"
        assert ours == theirs, f"{case['entry']}: the tokens before the second cut differ"
    return len(outcomes)


def test_the_head_adaptive_fixture_crosses_three_cuts_and_names_both_entries():
    for record in ADAKV_RECORD["models"].values():
        assert len(record["cases"][0]["cut_passes"]) >= 3
        assert {case["entry"] for case in record["cases"]} == {"decoding_adakv_snapkv",
                                                               "decoding_adakv_expected_attention_e2"}


def test_tiny_gqa_model_cuts_head_by_head_as_kvpress_until_its_masks_diverge():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    assert check_head_adaptive(run_head_adaptive(model, ADAKV_RECORD["models"]["tiny_gqa"])) == 2


@pytest.mark.slow
def test_smollm2_cuts_head_by_head_as_kvpress_until_its_masks_diverge(smollm2):
    assert check_head_adaptive(run_head_adaptive(smollm2[0], ADAKV_RECORD["models"]["smollm2"])) == 2
