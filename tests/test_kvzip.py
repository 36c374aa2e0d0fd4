"""KVzip: one replay for every ratio of a prefill, budgets across layers, storage per head, refusals."""
import pytest
import torch
from transformers import DynamicCache

import snapkv
import snapkv.reconstruction as reconstruction
from eval.runner import Runner
from tiny_models import tiny_model


def test_every_ratio_of_a_prefill_shares_one_replay_and_keeps_its_share(monkeypatch):
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    calls = []
    real = reconstruction.reconstruction_scores
    monkeypatch.setattr("snapkv.methods.kvzip.reconstruction_scores",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    settings = [snapkv.KVzip(budget=None, ratio=r, chunk_size=128) for r in (0.25, 0.5, 0.75)]
    with snapkv.compress(model, [snapkv.SnapKV(budget=64, window=8), *settings]) as session, torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        caches = session.caches
    assert len(calls) == 1  # three chunks replayed once for the three ratios
    for cfg, cache in zip(settings, caches[1:]):
        per_layer = [sum(len(p) for p in layer[0]) for layer in snapkv.kept_positions(cache)]
        assert sum(per_layer) == 3 * 2 * 300 - int(3 * 2 * 300 * cfg.ratio)  # kvpress: int(n_scores * ratio) go
        assert len(set(per_layer)) > 1  # across layers
        kept = snapkv.kept_positions(cache)
        assert all(set(range(4)) <= set(head.tolist()) for layer in kept for head in layer[0])  # the sinks


def test_the_replay_requests_follow_kvpress():
    tokenizer = type("T", (), {})()
    tokenizer.encode = lambda text, return_tensors=None, add_special_tokens=False: torch.tensor([[len(text)]])
    context = torch.arange(10, 35)[None]  # 2 prefix tokens, then 23 context tokens in chunks of 10
    requests = reconstruction.replay_requests(tokenizer, context, 2, torch.tensor([[7]]), 10)
    assert [(a, b) for a, b, _ in requests] == [(2, 12), (12, 22), (22, 25)]
    first, second = requests[0][2][0].tolist(), requests[1][2][0].tolist()
    assert first == [len(reconstruction.REPEAT_FIRST), 7, *range(12, 22)]
    assert second == [len(reconstruction.REPEAT_NEXT), *range(14, 22), 7, *range(22, 32)]  # the last 8 of chunk 1


def test_kvzip_decodes_alone_and_equals_its_solo_run_in_a_shared_one():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(6))
    runner = Runner(model)
    settings = [snapkv.KVzip(budget=None, ratio=0.5), snapkv.SnapKV(budget=64, window=8),
                snapkv.KVzip(budget=None, ratio=0.75)]
    solo = [runner.generate(ids, cfg, 6).tokens for cfg in settings]
    assert [g.tokens for g in runner.generate_shared(ids, settings, 6, together=True)] == solo


def test_kvzip_refusals_are_one_line():
    model = tiny_model("llama-gqa")
    model.config.name_or_path = ""
    with pytest.raises(snapkv.InputError, match="kvzip: the model's tokenizer is needed"):
        with snapkv.compress(model, snapkv.KVzip(budget=32)), torch.no_grad():
            model(torch.randint(0, 128, (1, 100)), cache=DynamicCache(config=model.config), use_cache=True)
    model = tiny_model("llama-gqa")
    with pytest.raises(snapkv.InputError, match="kvzip: one prompt of token ids without padding"):
        with snapkv.compress(model, snapkv.KVzip(budget=32)), torch.no_grad():
            model(torch.randint(0, 128, (2, 100)), cache=DynamicCache(config=model.config), use_cache=True)


def test_kept_positions_refuses_a_merged_cache():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(8))
    with snapkv.compress(model, [snapkv.SnapKV(budget=48, window=8), snapkv.SnapKV(budget=64, window=8)]) as s, \
            torch.no_grad():
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        merged = snapkv.merge_caches(s.caches)
        with pytest.raises(snapkv.InputError, match="kept_positions: a merged cache"):
            snapkv.kept_positions(merged)
