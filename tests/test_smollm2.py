"""Integration on the real SmolLM2-135M-Instruct GGUF: a needle the model finds, with and without SnapKV."""
import pytest
import torch

import snapkv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2):
    from eval.runner import Runner
    from omegaconf import OmegaConf
    return Runner(*smollm2), OmegaConf.load("conf/model/smollm2-135m.yaml")


def test_needle_answered_with_full_kv_and_snapkv(smol):
    from eval.chat import stop_token_ids
    from eval.needle.build import Needle, insert_needles, prompt_ids, sentence_end_ids
    from eval.needle.haystack import haystack_tokens
    runner, cfg = smol
    tok = runner.tokenizer
    needle = Needle("The secret ingredient in Grandma Rosa's lemon cake is a spoonful of cardamom.", "cardamom")
    stream = haystack_tokens(tok, "noise", 1200)
    context, _ = insert_needles(tok, stream, [needle], [40], sentence_end_ids(tok, stream))
    question = "What is the secret ingredient in Grandma Rosa's lemon cake?"
    ids = torch.tensor([prompt_ids(tok, context, question, "template")])
    stops = stop_token_ids(runner.model, tok)
    full = runner.generate(ids, snapkv.FullKV(), 16, stop_ids=stops)
    assert "cardamom" in tok.decode(full.tokens)
    cfg_snap = snapkv.SnapKV(budget=1024, window=32, kernel=7)
    snap = runner.generate(ids, cfg_snap, 16, stop_ids=stops)
    assert "cardamom" in tok.decode(snap.tokens)
    assert snap.cache_lengths == [1024] * 30
    assert full.cache_lengths == [ids.shape[1]] * 30
