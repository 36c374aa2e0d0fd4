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
    # a buffer shorter than the interval: a cut after a verification pass reads what plain decoding's would
    "expected_attention-cuts": lambda: snapkv.build_config("expected_attention", budget=40, decode_target=36,
                                                           decode_interval=10, decode_buffer=6),
}


def passes(model):
    """A list that counts the model's forward passes while the returned hook is attached."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


def held(cache) -> tuple:
    """What a cache holds after a generation: its reported length, each layer's tokens, the cuts while decoding, the
    positions each head kept."""
    state = state_of(cache)
    kept = [[[h.tolist() for h in row] for row in layer] for layer in snapkv.kept_positions(cache)]
    return (cache.get_seq_length(), state.next_positions.tolist(), state.decoding_cuts,
            [layer.get_seq_length() if hasattr(layer, "segment") else layer.keys.shape[-2] for layer in cache.layers],
            kept)


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


# -- the task harness: decoding.speculative (eval.speculation, eval.decoding.greedy_rows) -------------------------

def lookup(draft_tokens=5, ngram=2):
    from eval.speculation import PromptLookup
    return lambda prompt: PromptLookup(prompt, draft_tokens, ngram)


@pytest.mark.parametrize("seed", range(12))
def test_prompt_lookup_drafts_as_transformers_candidate_generator_does(seed):
    """The reference: transformers' own ``PromptLookupCandidateGenerator`` (no logits processor), on sequences of few
    symbols (many n-gram matches), with and without a stop id among the drafts."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    g = torch.Generator().manual_seed(seed)
    sequence = torch.randint(0, 6, (1, int(torch.randint(2, 60, (1,), generator=g))), generator=g)
    draft_tokens, ngram = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    stop = {seed % 6} if seed % 2 else set()
    reference = PromptLookupCandidateGenerator(torch.tensor(sorted(stop)) if stop else None, draft_tokens, ngram,
                                               max_length=10_000)
    expected, _ = reference.get_candidates(sequence)
    from eval.speculation import PromptLookup
    split = int(torch.randint(1, sequence.shape[1] + 1, (1,), generator=g))
    ids = sequence[0].tolist()
    mine = PromptLookup(ids[:split], draft_tokens, ngram).drafts(ids[split:], 10_000, stop)
    assert mine == expected[0, sequence.shape[1]:].tolist()


def harness_prompt() -> torch.Tensor:
    base = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(11))
    return torch.cat([base, base, base[:, :30]], dim=1)


HARNESS = {
    "full": lambda: snapkv.FullKV(),
    "snapkv": lambda: snapkv.SnapKV(budget=48, window=8, kernel=5),
    "pyramidkv": lambda: snapkv.PyramidKV(budget=48, window=8, kernel=5),
    "adakv": lambda: snapkv.build_config("adakv", budget=48, window=8),
    "think": lambda: snapkv.build_config("think", budget=48, window=8, key_channel_ratio=0.5),
    "snapkv-cuts": lambda: snapkv.SnapKV(budget=48, window=8, kernel=5, decode_target=44, decode_interval=8),
    "adakv-cuts": lambda: snapkv.build_config("adakv", budget=48, window=8, decode_target=44, decode_interval=9),
    # a buffer shorter than the interval: a cut after a verification pass reads what plain decoding's would
    "expected_attention-cuts": lambda: snapkv.build_config("expected_attention", budget=48, decode_target=40,
                                                           decode_interval=10, decode_buffer=6),
}


@pytest.fixture(scope="module")
def runner():
    from eval.runner import Runner
    from tiny_models import tiny_model
    return Runner(tiny_model("llama-gqa"))


def plain_and_speculative(runner, call):
    """``call()`` without, then with prompt-lookup drafts."""
    runner.drafting = None
    plain = call()
    runner.drafting = lookup()
    try:
        return plain, call()
    finally:
        runner.drafting = None


@pytest.mark.parametrize("setting", sorted(HARNESS))
def test_the_harness_speculates_exactly_on_every_cache_kind(runner, setting):
    """Uniform, per-layer, head-adaptive, fewer-channel and cutting caches: the harness's own prompt-lookup loop writes
    plain greedy's tokens in fewer passes, and the records carry passes, drafted and accepted tokens."""
    ids = harness_prompt()
    plain, fast = plain_and_speculative(runner, lambda: runner.generate(ids, HARNESS[setting](), 30))
    assert fast.tokens == plain.tokens and len(plain.tokens) == 30
    assert plain.decode_passes == 29 and plain.drafted_tokens is None
    assert fast.decode_passes < 29 and fast.accepted_tokens > 0 and fast.drafted_tokens >= fast.accepted_tokens
    assert fast.decode_passes + fast.accepted_tokens == 29  # each pass writes one token, plus the drafts it accepts
    assert fast.cost()["decode_passes"] == fast.decode_passes and "accepted_tokens" in fast.cost()
    if "cuts" in setting:  # the cuts fell where plain decoding's did, and the caches ended alike
        assert fast.decoding == {**plain.decoding, "decode_cut_s": fast.decoding["decode_cut_s"]}
        assert plain.decoding["decode_cuts"] > 0


@pytest.mark.parametrize("name", ["gemma2", "cohere2"])
def test_the_harness_speculates_on_models_with_sliding_layers(name):
    """A sliding layer records its past while the harness speculates, and holds its window again after."""
    from eval.runner import Runner
    sliding = Runner(build(READ[name]))
    ids = repetitive_prompt()
    plain, fast = plain_and_speculative(sliding, lambda: sliding.generate(ids, snapkv.SnapKV(budget=40, window=8), 24))
    assert fast.tokens == plain.tokens and fast.accepted_tokens > 0
    assert fast.drafted_tokens and fast.decode_passes > fast.drafted_tokens // 5  # passes without drafts came too
    import copy
    from eval.speculation import AssistantDrafts
    draft = copy.deepcopy(sliding.model)  # a draft with sliding layers: its own cache records its past too
    sliding.drafting = lambda prompt: AssistantDrafts(draft, prompt, 6)
    try:
        assisted = sliding.generate(ids, snapkv.SnapKV(budget=40, window=8), 24)
    finally:
        sliding.drafting = None
    assert assisted.tokens == plain.tokens and assisted.accepted_tokens > 0


def test_merged_caches_and_items_in_flight_speculate_exactly(runner):
    """Settings decoded together (a merged cache) and prompts in flight (prefilled each, or as one left-padded batch):
    every row accepts the drafts the batch's slowest row accepts, so each writes what it writes without drafts; a row
    that stops leaves the others speculating, and is charged only the passes it wrote in."""
    ids = harness_prompt()
    settings = [snapkv.FullKV(), snapkv.SnapKV(budget=48, window=8, kernel=5),
                snapkv.PyramidKV(budget=48, window=8, kernel=5)]
    plain, fast = plain_and_speculative(runner, lambda: runner.generate_shared(ids, settings, 20, together=True))
    assert [g.tokens for g in fast] == [g.tokens for g in plain]
    assert fast[0].decode_rows == 3 and fast[0].decode_passes < plain[0].decode_passes
    import copy
    from eval.speculation import AssistantDrafts
    draft = copy.deepcopy(runner.model)
    runner.drafting = lambda prompt: AssistantDrafts(draft, prompt, 4)  # each row its own draft cache
    try:
        assisted = runner.generate_shared(ids, settings, 20, together=True)
    finally:
        runner.drafting = None
    assert [g.tokens for g in assisted] == [g.tokens for g in plain] and assisted[1].accepted_tokens > 0
    other = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2)).tolist()[0]
    prompts = [ids[0].tolist(), other * 2]
    stop = [plain_and_speculative(runner, lambda: runner.generate(torch.tensor([other * 2]), settings[1], 8))[0]
            .tokens[5]]  # the second prompt's sixth token: that row stops early
    for prefill in ("each", "padded"):
        plain, fast = plain_and_speculative(runner, lambda prefill=prefill: runner.generate_items(
            prompts, [snapkv.SnapKV(budget=48, window=8, kernel=5)], 16, stop_ids=stop, together=True,
            prefill=prefill))
        assert [[g.tokens for g in item] for item in fast] == [[g.tokens for g in item] for item in plain]
        assert len(plain[1][0].tokens) <= 6 < len(plain[0][0].tokens)
        for item in fast + plain:
            g = item[0]
            assert g.decode_passes + (g.accepted_tokens or 0) == len(g.tokens) - 1
        assert fast[0][0].decode_passes < plain[0][0].decode_passes


def test_an_assistant_model_drafts_in_the_harness(runner):
    """``speculative=assistant``: a draft model of the same vocabulary over its own cache, cropped to what the target
    accepted: the target's tokens are plain greedy's (a copy of the target drafts well, another model badly)."""
    import copy
    from eval.speculation import AssistantDrafts
    from tiny_models import tiny_model
    ids = harness_prompt()
    cfg = snapkv.SnapKV(budget=48, window=8, kernel=5)
    runner.drafting = None
    plain = runner.generate(ids, cfg, 24)
    out = {}
    for name, draft in (("copy", copy.deepcopy(runner.model)), ("other", tiny_model("llama-gqa", seed=1))):
        runner.drafting = lambda prompt, draft=draft: AssistantDrafts(draft, prompt, 4)
        try:
            out[name] = runner.generate(ids, cfg, 24)
        finally:
            runner.drafting = None
    assert out["copy"].tokens == plain.tokens and out["other"].tokens == plain.tokens
    assert out["copy"].accepted_tokens > out["other"].accepted_tokens
    assert out["copy"].decode_passes < plain.decode_passes


def test_the_app_speculates_into_its_own_folder_and_fingerprint(tmp_path):
    """``decoding.speculative``: the folder gets ``-lookup5``, the fingerprint ``decoding.*`` (a plain run's has none:
    older folders stay valid), every record its passes and drafts; the tokens are the plain run's."""
    import json
    from conftest import compose
    from eval.longbench.__main__ import run
    from test_query_aware import write_rows
    write_rows(tmp_path / "hotpotqa.jsonl")
    base = ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "longbench.datasets=[hotpotqa]",
            f"longbench.data_dir={tmp_path}", "longbench.max_new_tokens=12"]
    fast = base + ["decoding.speculative=prompt_lookup", "decoding.draft_tokens=5"]
    assert compose("longbench", fast, hydra_node=True).hydra.run.dir.endswith("/snapkv-b64-w8-k7-maxpool-mean-lookup5")
    run(compose("longbench", fast + [f"output_dir={tmp_path}/fast"]))
    run(compose("longbench", base + [f"output_dir={tmp_path}/plain"]))
    settings = json.loads((tmp_path / "fast" / "settings.json").read_text())
    assert {k: v for k, v in settings.items() if k.startswith("decoding.")} == {
        "decoding.speculative": "prompt_lookup", "decoding.draft_tokens": 5, "decoding.ngram": 2}
    assert not any(k.startswith("decoding.") for k in json.loads((tmp_path / "plain" / "settings.json").read_text()))
    assisted = base + ["decoding.speculative=assistant", "decoding.assistant=tiny-llama"]  # drafting for itself
    assert compose("longbench", assisted, hydra_node=True).hydra.run.dir.endswith("-assisted10-tiny-llama")
    other_ngram = compose("longbench", fast + ["decoding.ngram=3"], hydra_node=True).hydra.run.dir
    assert other_ngram.endswith("-lookup5-ngram3")  # every option apart: a sweep over one never shares a folder
    run(compose("longbench", assisted + [f"output_dir={tmp_path}/assisted"]))
    records = {name: [json.loads(line) for line in (tmp_path / name / "pred" / "hotpotqa.jsonl").open()]
               for name in ("fast", "plain", "assisted")}
    assert [r["pred"] for r in records["fast"]] == [r["pred"] for r in records["plain"]]
    assert [r["pred"] for r in records["assisted"]] == [r["pred"] for r in records["plain"]]
    assert all(r["cost"]["accepted_tokens"] > 0 for r in records["assisted"])
    assert all({"decode_passes", "drafted_tokens", "accepted_tokens"} <= set(r["cost"]) for r in records["fast"])
    assert all("drafted_tokens" not in r["cost"] and "decode_passes" in r["cost"] for r in records["plain"])
    with pytest.raises(snapkv.InputError, match="decoding.speculative"):  # another setting: not mixed in
        run(compose("longbench", base + [f"output_dir={tmp_path}/fast"]))


@pytest.mark.parametrize("overrides,why", [
    (["decoding.speculative=medusa"], r"^decoding.speculative='medusa' is not allowed"),
    (["decoding.speculative=prompt_lookup", "decoding.draft_tokens=0"], r"^decoding.draft_tokens=0 is not allowed"),
    (["decoding.speculative=assistant"], r"^decoding.assistant: speculative=assistant needs the draft model"),
    (["decoding.assistant=tiny-llama"], r"^decoding.assistant='tiny-llama' is set but decoding.speculative=none"),
    (["decoding.speculative=assistant", "decoding.assistant=nope"], r"^decoding.assistant='nope' is not a model"),
])
def test_bad_decoding_options_stop_in_one_line(tmp_path, overrides, why):
    from conftest import compose
    from eval.longbench.__main__ import run
    from test_query_aware import write_rows
    write_rows(tmp_path / "hotpotqa.jsonl", 1)
    with pytest.raises(snapkv.InputError, match=why) as refused:
        run(compose("longbench", ["model=tiny-llama", "longbench.datasets=[hotpotqa]", f"longbench.data_dir={tmp_path}",
                                  f"output_dir={tmp_path}/out", *overrides]))
    assert "\n" not in str(refused.value)


def test_a_crop_into_a_prompt_cut_after_its_prefill_is_refused_too():
    """KVzip cuts once the whole prompt has been prefilled (after the pass): the floor follows that cut."""
    from tiny_models import tiny_model
    model = tiny_model("llama-gqa")  # its character tokenizer gives KVzip its replay prompts
    with torch.no_grad(), snapkv.compress(model, snapkv.build_config("kvzip", budget=None, ratio=0.5)):
        cache = DynamicCache(config=model.config)
        model(repetitive_prompt(), cache=cache, use_cache=True)
        with pytest.raises(snapkv.InputError, match=r"^crop\(-1\): the cache was compressed after 100 tokens"):
            cache.crop(-1)


def test_a_cache_that_rolls_back_is_freed_as_soon_as_it_is_dropped(models):
    """The crop a session installs holds its cache weakly: no reference cycle keeps a finished cache (its tensors)
    alive until the garbage collector runs, so the next prompt's peak does not carry it (eval.bench's measured
    peaks saw it)."""
    import gc
    import weakref
    model, _ = models
    gc.disable()
    try:
        with torch.no_grad(), snapkv.compress(model, snapkv.SnapKV(budget=40, window=8, kernel=5)):
            cache = DynamicCache(config=model.config)
            model(repetitive_prompt(), cache=cache, use_cache=True)
            cache.crop(0)
            keys = weakref.ref(cache.layers[0].keys)
            del cache
        assert keys() is None
    finally:
        gc.enable()
