"""Inside ``snapkv.compress`` a prefill is compressed however the model is called: with a cache, without
one (the cache transformers would make is the session's), through ``generate``, and a later turn."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
from tiny_models import tiny_model

CFG = snapkv.SnapKV(budget=48, window=8, kernel=5)


def _kept(cache):
    return [[[p.tolist() for p in row] for row in layer] for layer in snapkv.kept_positions(cache)]


@pytest.mark.parametrize("use_cache", [True, None])  # None: the model config's default (True)
def test_a_plain_forward_call_without_a_cache_is_compressed(use_cache):
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 150))
    with torch.no_grad(), snapkv.compress(model, CFG) as session:
        given = model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        plain = model(ids) if use_cache is None else model(ids, use_cache=use_cache)
        assert session.cache_lengths == [48] * model.config.num_hidden_layers
        assert session.caches == [plain.cache]
        assert [layer.keys.shape[-2] for layer in plain.cache.layers] == [48] * model.config.num_hidden_layers
        assert _kept(plain.cache) == _kept(given.cache)
        torch.testing.assert_close(plain.logits, given.logits)
        # the next token continues at the prompt's length, as after an explicit cache
        token = plain.logits[:, -1:].argmax(-1)
        after_plain = model(token, cache=plain.cache).logits
        after_given = model(token, cache=given.cache).logits
        torch.testing.assert_close(after_plain, after_given)


def test_use_cache_false_stores_nothing_and_compresses_nothing():
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 150))
    with torch.no_grad(), snapkv.compress(model, CFG) as session:
        out = model(ids, use_cache=False)
        assert out.cache is None and session.caches == []


def test_generate_and_a_later_turn_after_a_plain_call():
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 150))
    with torch.no_grad(), snapkv.compress(model, CFG) as session:
        plain = model(ids)
        assert session.cache_lengths == [48] * model.config.num_hidden_layers
        turn = torch.randint(0, 128, (1, 5))
        later = model(turn, cache=plain.cache)  # appended uncompressed at positions 150..154
        assert [layer.keys.shape[-2] for layer in later.cache.layers] == [53] * model.config.num_hidden_layers
        assert later.cache.get_seq_length() == 155
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert out.shape[1] == 154 and session.cache_lengths == [48] * model.config.num_hidden_layers
