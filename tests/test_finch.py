"""FINCH (``snapkv/methods/finch.py``) and the two protocol stages it takes: the question's length at the prefill
(``Method.needs_question_length``) and re-rotated keys (``Method.rerotates_keys``: the cache continues as a plain one
of ``n`` tokens). Its parity with kvpress's ``FinchPress`` (kept positions per (layer, KV head) and 8 greedy tokens,
both models, four ratios) is ``tests/test_kvpress_parity.py`` on ``fixtures/kvpress/entries/finch.json.gz``; the
decoding paths here (``generate``, the runner) are checked against the same fixture's tokens."""
from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import snapkv
from eval.engine import Prompt, generate as engine_generate
from eval.runner import Runner
from snapkv.cache_state import state_of

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kvpress"
RECORD = json.loads(gzip.open(FIXTURES / "entries" / "finch.json.gz", "rt", encoding="utf-8").read())
TINY = RECORD["models"]["tiny_gqa"]
IDS = torch.tensor([TINY["ids"]])
QUESTION = TINY["cases"][0]["question_tokens"]  # 32


def tiny_model():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_gqa", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # its eos (2) is often the first token: decode all 8
    return model


def finch(ratio=0.5, **fields) -> snapkv.Method:
    return snapkv.Finch(budget=None, ratio=ratio, **fields)


def prefill(model, cfgs, question=QUESTION, ids=IDS):
    """One prefill of ``ids`` under ``cfgs``: (logits of its last token, the caches, the session's lengths)."""
    with torch.no_grad(), snapkv.compress(model, cfgs, question_tokens=question) as session:
        out = model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        caches, lengths = session.caches, session.lengths_per_setting
        session.caches = []
    return out.logits[:, -1], caches, lengths


def plain_copy(model, cache) -> DynamicCache:
    """A cache holding ``cache``'s keys and values, outside any session (transformers places tokens by its length)."""
    plain = DynamicCache(config=model.config)
    for idx, layer in enumerate(cache.layers):
        plain.update(layer.keys.clone(), layer.values.clone(), idx)
    return plain


def greedy(model, logits, cache, steps: int, start: int | None = None) -> list[int]:
    """``steps`` greedy tokens from ``logits`` and ``cache``; ``start``: explicit positions from there."""
    tokens = [int(logits[0].argmax())]
    with torch.no_grad():
        for step in range(steps - 1):
            extra = {} if start is None else {"position_ids": torch.tensor([[start + step]])}
            tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache, **extra).logits[0, -1].argmax()))
    return tokens


# -- the question's length --------------------------------------------------------------------------------------
def test_the_question_length_reaches_the_method_at_each_prefill(monkeypatch):
    seen = []
    scores = snapkv.Finch.prompt_scores

    def spy(self, ctx):
        seen.append(ctx.question_tokens)
        return scores(self, ctx)
    monkeypatch.setattr(snapkv.Finch, "prompt_scores", spy)
    model = tiny_model()
    with torch.no_grad(), snapkv.compress(model, finch(0.875), question_tokens=QUESTION) as session:
        model(IDS, cache=DynamicCache(config=model.config))
        first = session.caches[0]
        session.question_tokens = 12  # the next prompt's question
        model(IDS, cache=DynamicCache(config=model.config))
        second = session.caches[0]
    layers = len(model.model.layers)
    assert seen == [QUESTION] * layers + [12] * layers
    length = IDS.shape[1]
    for cache, question in ((first, QUESTION), (second, 12)):
        for rows in snapkv.kept_positions(cache):  # the question is the window: always kept
            for positions in rows[0]:
                assert set(range(length - question, length)) <= set(positions.tolist())
                assert len(positions) == int(length * (1 - 0.875))


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_missing_or_wrong_question_length_is_one_line_naming_what_to_pass():
    model = tiny_model()
    with pytest.raises(snapkv.InputError) as error, snapkv.compress(model, [snapkv.FullKV(), finch()]):
        model(IDS)
    message = one_line(error)
    assert message.startswith("finch:") and "question_tokens=" in message and "session.question_tokens" in message
    for wrong in (0, IDS.shape[1], True, 2.5):
        with pytest.raises(snapkv.InputError) as error, snapkv.compress(model, finch(), question_tokens=wrong):
            model(IDS)
        assert f"question_tokens={wrong!r}" in one_line(error)
    mask = torch.ones(2, IDS.shape[1], dtype=torch.long)
    mask[1, :10] = 0
    with pytest.raises(snapkv.InputError) as error, snapkv.compress(model, finch(), question_tokens=QUESTION):
        model(IDS.repeat(2, 1), attention_mask=mask)
    assert "left-padded" in one_line(error)
    with pytest.raises(snapkv.InputError) as error:
        snapkv.compress(model, finch(), compress_later_turns=True, question_tokens=QUESTION).__enter__()
    assert "compress_later_turns" in one_line(error)
    # a method not reading it ignores it, and runs without it
    with snapkv.compress(model, snapkv.SnapKV(budget=64, window=8)):
        model(IDS)


def test_the_fields_are_checked():
    with pytest.raises(snapkv.InputError, match="chunk_length"):
        snapkv.Finch(budget=100, chunk_length=50)  # chunks keep a share each: a ratio
    with pytest.raises(snapkv.InputError, match="gqa"):
        finch(gqa="repeat")
    model = tiny_model()
    with pytest.raises(snapkv.InputError, match="chunk_length=40 must be larger"):
        prefill(model, finch(0.5, chunk_length=40))  # kvpress's condition: 40 <= 32 / (1 - 0.5)


def test_chunks_keep_their_share_each_and_every_layer_as_many():
    model = tiny_model()
    _, [cache], [lengths] = prefill(model, finch(0.5, chunk_length=100))
    assert lengths == [150] * len(model.model.layers)  # three chunks of 100 keep 50 each
    for rows in snapkv.kept_positions(cache):
        for positions in rows[0]:
            assert [int(((positions >= c) & (positions < c + 100)).sum()) for c in (0, 100, 200)] == [50, 50, 50]


# -- re-rotated keys ----------------------------------------------------------------------------------------------
def test_rerotated_keys_equal_a_plain_prefill_of_the_kept_tokens_at_their_new_positions():
    """Layer 0's keys and values depend on the token and its position only: a plain prefill of the tokens a head
    kept, at positions 0..n-1, holds the keys the re-rotated cache holds for that head."""
    model = tiny_model()
    _, [cache], _ = prefill(model, finch(0.75))
    kept = snapkv.kept_positions(cache)[0][0]  # layer 0, row 0: per KV head
    for head, positions in enumerate(kept):
        with torch.no_grad():
            plain = model(IDS[:, positions], use_cache=True).cache.layers[0]
        torch.testing.assert_close(cache.layers[0].keys[0, head], plain.keys[0, head], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.layers[0].values[0, head], plain.values[0, head], rtol=0, atol=0)
    # without re-rotation the kept keys stay at their prompt positions, and decoding at the prompt's length
    _, [cache], _ = prefill(model, finch(0.75, rerotate_keys=False))
    with torch.no_grad():
        full = model(IDS, use_cache=True).cache.layers[0]
    for head, positions in enumerate(snapkv.kept_positions(cache)[0][0]):
        assert torch.equal(cache.layers[0].keys[0, head], full.keys[0, head, positions])
    assert cache.get_seq_length() == IDS.shape[1] and not state_of(cache).renumbered


def test_decoding_continues_at_n_in_the_session_in_generate_and_in_the_runner():
    model = tiny_model()
    length = IDS.shape[1]
    for case in TINY["cases"]:
        cfg = finch(case["ratio"])
        logits, [cache], [lengths] = prefill(model, cfg)
        n = lengths[0]
        assert lengths == [n] * len(model.model.layers) and n == max(1, int(length * (1 - case["ratio"])))
        assert cache.get_seq_length() == n and state_of(cache).renumbered
        reference = plain_copy(model, cache)
        with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=QUESTION):
            # the next token at position n, whatever position the caller passes
            step = model(torch.tensor([[5]]), cache=cache, position_ids=torch.tensor([[length]])).logits[0, -1]
        at_n = model(torch.tensor([[5]]), cache=copy.deepcopy(reference), position_ids=torch.tensor([[n]]))
        at_length = model(torch.tensor([[5]]), cache=copy.deepcopy(reference), position_ids=torch.tensor([[length]]))
        torch.testing.assert_close(step, at_n.logits[0, -1], rtol=0, atol=1e-5)
        assert not torch.allclose(step, at_length.logits[0, -1], atol=1e-5)
        assert cache.get_seq_length() == n + 1
        # kvpress's tokens: the session's own steps, generate (which counts positions from the prompt's length),
        # the runner's decode loop, and the engine's call with the prompt's question part
        assert greedy(model, logits, plain_copy(model, cache_after_prefill(model, cfg)), 8, start=n) == case["tokens"]
        with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=QUESTION):
            generated = model.generate(IDS, max_new_tokens=8, do_sample=False)[0, length:].tolist()
        assert generated == case["tokens"]
        runner = Runner(model)
        assert runner.generate(IDS, cfg, 8, question_in_prompt=QUESTION).tokens == case["tokens"]
        prompt = Prompt(TINY["ids"], 8, [], question_tokens=QUESTION)
        assert [g.tokens for g in engine_generate(runner, prompt, [cfg, snapkv.FullKV()])][0] == case["tokens"]
        [[items]] = runner.generate_items([TINY["ids"]], [cfg], 8, questions_in_prompts=[QUESTION])
        assert items.tokens == case["tokens"]


def cache_after_prefill(model, cfg):
    return prefill(model, cfg)[1][0]


def test_the_runner_gives_each_prompt_of_a_batch_its_own_question_length():
    model = tiny_model()
    runner = Runner(model)
    prompts = [TINY["ids"], TINY["ids"][:250]]
    questions = [QUESTION, 20]
    cfgs = [finch(0.5), snapkv.SnapKV(budget=64, window=8)]
    together = runner.generate_items(prompts, cfgs, 6, questions_in_prompts=questions)
    for prompt, question, per_setting in zip(prompts, questions, together):
        alone = runner.generate_shared(torch.tensor([prompt]), cfgs, 6, question_in_prompt=question)
        assert [g.tokens for g in per_setting] == [g.tokens for g in alone]
        assert per_setting[0].cache_lengths == [int(len(prompt) * 0.5)] * 2


# -- shared prefill -----------------------------------------------------------------------------------------------
def test_a_shared_prefill_leaves_each_cache_equal_to_its_solo_run():
    model = tiny_model()
    settings = [finch(0.5), snapkv.SnapKV(budget=100, window=16), finch(0.75, gqa="max", normalize_scores=False),
                snapkv.FullKV(), finch(0.25, rerotate_keys=False), snapkv.Finch(budget=60),
                snapkv.Knorm(budget=None, ratio=0.5)]
    logits, shared, lengths = prefill(model, settings)
    for cfg, cache, kept in zip(settings, shared, lengths):
        solo_logits, [solo], [solo_lengths] = prefill(model, cfg)
        assert kept == solo_lengths, cfg.label()
        torch.testing.assert_close(logits, solo_logits, rtol=0, atol=0)
        for ours, theirs in zip(cache.layers, solo.layers):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), cfg.label()
        assert [[p.tolist() for p in rows[0]] for rows in snapkv.kept_positions(cache)] == \
            [[p.tolist() for p in rows[0]] for rows in snapkv.kept_positions(solo)]
        assert cache.get_seq_length() == solo.get_seq_length()
        with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=QUESTION):
            assert greedy(model, logits, cache, 4) == greedy(model, solo_logits, solo, 4), cfg.label()


def test_merged_with_other_settings_each_row_decodes_as_alone():
    model = tiny_model()
    settings = [finch(0.5), snapkv.SnapKV(budget=100, window=16), finch(0.875)]
    logits, caches, _ = prefill(model, settings)
    alone = []
    with torch.no_grad(), snapkv.compress(model, settings, question_tokens=QUESTION):
        for cache in caches:
            alone.append(greedy(model, logits, copy.deepcopy(cache), 5))
        merged = snapkv.merge_caches(caches)
        tokens = [[int(logits[0].argmax())] for _ in settings]
        for _ in range(4):
            step = model(torch.tensor([[t[-1]] for t in tokens]), cache=merged).logits[:, -1].argmax(-1)
            for row, token in zip(tokens, step.tolist()):
                row.append(token)
    assert tokens == alone


# -- the board ----------------------------------------------------------------------------------------------------
def test_finch_is_on_the_query_aware_board_only():
    from snapkv.registry import kvpress_entries
    assert kvpress_entries("aware")["finch"] == ("finch", "finch", {})
    assert "finch" not in kvpress_entries("agnostic")


def test_a_query_agnostic_run_of_finch_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from eval.engine import PredictionTask, run
    task = PredictionTask()
    task.splits_question = True
    cfg = OmegaConf.create({"query_aware": False, "output_dir": str(tmp_path),
                            "compressor": {"method": "finch", "budget": None, "ratio": 0.5}})
    with pytest.raises(snapkv.InputError, match="query_aware=true"):
        run(task, cfg)


@pytest.mark.slow
def test_smollm2_generate_and_the_runner_decode_kvpress_tokens(smollm2, monkeypatch):
    """On SmolLM2 the tokens depend on the position the decoding continues at (n, not the prompt's length)."""
    model = smollm2[0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    record = RECORD["models"]["smollm2"]
    ids = torch.tensor([record["ids"]])
    question = record["cases"][0]["question_tokens"]
    runner = Runner(model)
    for case in record["cases"][:2]:
        cfg = finch(case["ratio"])
        with torch.no_grad(), snapkv.compress(model, cfg, question_tokens=question):
            generated = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert generated == case["tokens"]
        assert runner.generate(ids, cfg, 8, question_in_prompt=question).tokens == case["tokens"]
