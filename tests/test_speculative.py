"""Speculative decoding over a compressed cache (the SnapKV paper's section 5): greedy prompt-lookup and assisted
decoding write exactly plain greedy's tokens inside ``snapkv.compress``, the prompt alone is compressed, and the
crops that roll back rejected drafts roll back the session's positions and counts too."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import snapkv
from snapkv.cache_state import state_of
from test_families import READ, build

NEW = 24


@pytest.fixture(scope="module")
def models():
    return build(READ["llama"]), build(READ["qwen2"])  # the target and a draft model of the same vocabulary


def repetitive_prompt() -> torch.Tensor:
    """A prompt that repeats itself: prompt lookup finds drafts in it and some are accepted."""
    base = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    return torch.cat([base, base, base[:, :20]], dim=1)


SETTINGS = {
    "snapkv": lambda: snapkv.SnapKV(budget=40, window=8, kernel=5),
    "snapkv-repeat": lambda: snapkv.SnapKV(budget=40, window=8, kernel=5, gqa="repeat"),
    "pyramidkv": lambda: snapkv.build_config("pyramidkv", budget=48, window=8, kernel=5),
    "streamingllm": lambda: snapkv.build_config("streamingllm", budget=40),
    "full": lambda: snapkv.build_config("full"),
    "adakv": lambda: snapkv.build_config("adakv", budget=None, ratio=0.5),               # ragged: heads' own slots
    "think": lambda: snapkv.build_config("think", budget=48, key_channel_ratio=0.5),     # fewer key channels
    # cuts while decoding: a verification pass buffers, and cuts once its accepted tokens are known
    "snapkv-cuts": lambda: snapkv.SnapKV(budget=40, window=8, kernel=5, decode_target=36, decode_interval=8),
    "streamingllm-cuts": lambda: snapkv.build_config("streamingllm", budget=40, decode_target=36,
                                                     decode_interval=5),
    "adakv-cuts": lambda: snapkv.build_config("adakv", budget=40, window=8, decode_target=36, decode_interval=9),
}


def passes(model):
    """A list that counts the model's forward passes while the returned hook is attached."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


def held(cache) -> tuple:
    """What a cache holds after a generation: its reported length, each layer's tokens, the cuts while decoding."""
    state = state_of(cache)
    return (cache.get_seq_length(), state.next_positions.tolist(), state.decoding_cuts,
            [layer.get_seq_length() if hasattr(layer, "segment") else layer.keys.shape[-2] for layer in cache.layers])


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_prompt_lookup_and_assisted_decoding_write_plain_greedys_tokens(models, setting):
    model, draft = models
    ids = repetitive_prompt()
    outs, caches = {}, {}
    with torch.no_grad(), snapkv.compress(model, SETTINGS[setting]()):
        for way, speculation in (("greedy", {}), ("lookup", {"prompt_lookup_num_tokens": 5}),
                                 ("assisted", {"assistant_model": draft})):
            caches[way] = DynamicCache(config=model.config)
            calls, hook = passes(model)
            outs[way] = model.generate(ids, cache=caches[way], max_new_tokens=NEW, do_sample=False,
                                       min_new_tokens=NEW, **speculation)
            hook.remove()
            outs[way + " passes"] = len(calls)
    assert torch.equal(outs["lookup"], outs["greedy"]) and torch.equal(outs["assisted"], outs["greedy"])
    assert outs["lookup passes"] < NEW  # drafts were accepted: fewer target passes than tokens
    # the caches hold what greedy's does: a cut while decoding counted accepted tokens only, at greedy's steps
    assert held(caches["lookup"]) == held(caches["greedy"]) and held(caches["assisted"]) == held(caches["greedy"])
    assert ("cuts" in setting) == (held(caches["greedy"])[2] > 0)


def test_the_draft_model_can_be_compressed_too(models):
    model, draft = models
    ids = repetitive_prompt()
    with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8, kernel=5)):
        greedy = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        with snapkv.compress(draft, snapkv.build_config("streamingllm", budget=32)):
            assisted = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                      assistant_model=draft)
    assert torch.equal(assisted, greedy)


def test_crops_roll_back_positions_and_counts_and_a_second_turn_follows(models):
    """After a speculative turn the cache reports what greedy's does, and a second turn on it equals greedy's."""
    model, _ = models
    ids = repetitive_prompt()
    turn = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(9))
    runs = []
    for lookup in (None, 5):
        with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8, kernel=5)):
            cache = DynamicCache(config=model.config)
            first = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                   prompt_lookup_num_tokens=lookup)
            state = state_of(cache)
            counts = (cache.get_seq_length(), state.consumed, state.next_positions.tolist(),
                      [layer.keys.shape[-2] for layer in cache.layers])
            second = model.generate(torch.cat([first, turn], dim=1), cache=cache, max_new_tokens=8, do_sample=False,
                                    min_new_tokens=8)
        runs.append((first, counts, second))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
    assert runs[0][1] == runs[1][1]


def test_a_crop_into_the_compressed_prompt_is_refused_in_one_line(models):
    model, _ = models
    with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8, kernel=5)):
        cache = DynamicCache(config=model.config)
        model(repetitive_prompt(), cache=cache, use_cache=True)
        model(torch.tensor([[7, 8, 9]]), cache=cache, use_cache=True)
        cache.crop(-2)
        assert cache.get_seq_length() == 101 and [layer.keys.shape[-2] for layer in cache.layers] == [41] * 3
        with pytest.raises(snapkv.InputError, match=r"^crop\(-2\): the cache was compressed after 100 tokens"):
            cache.crop(-2)


def test_a_verification_pass_crossing_a_cut_while_decoding_is_refused_in_one_line(models):
    """Drafts are cut to ``tokens_before_cut - 1``; a caller's own pass crossing the cut is refused (its later tokens
    would be verified on a cache plain decoding had cut)."""
    model, _ = models
    cfg = snapkv.SnapKV(budget=40, window=8, kernel=5, decode_target=36, decode_interval=8)
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        model(repetitive_prompt(), cache=cache, use_cache=True)
        assert snapkv.tokens_before_cut(cache) == 8
        with snapkv.speculating(cache):
            model(torch.tensor([[7, 8, 9]]), cache=cache, use_cache=True)
            cache.crop(-1)
            assert snapkv.tokens_before_cut(cache) == 6
            with pytest.raises(snapkv.InputError, match=r"^snapkv: a verification pass of 7 tokens crosses the cut "
                                                        r"due after 6 more") as refused:
                model(torch.arange(3, 10)[None], cache=cache, use_cache=True)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", sorted(n for n in READ if READ[n].sliding))
def test_models_with_sliding_layers_speculate_exactly(name):
    """A sliding-window layer records its past while speculating (transformers' ``activate_past_recording``), so a crop
    restores the tokens its window had let go of; after, it holds its window again."""
    model = build(READ[name])
    ids = repetitive_prompt()
    with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8, kernel=5)):
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        greedy = model.generate(ids, cache=caches[0], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        lookup = model.generate(ids, cache=caches[1], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                prompt_lookup_num_tokens=5)
    assert torch.equal(lookup, greedy)
    assert [layer.keys.shape[-2] for layer in caches[1].layers] == [layer.keys.shape[-2] for layer in caches[0].layers]
    assert any(getattr(layer, "is_sliding", False) and not layer.record_past for layer in caches[1].layers)


def test_output_dicts_are_refused_in_one_line(models):
    model, _ = models
    with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8)):
        with pytest.raises(snapkv.InputError, match="^return_dict_in_generate"):
            model.generate(repetitive_prompt(), max_new_tokens=4, prompt_lookup_num_tokens=3,
                           return_dict_in_generate=True)
