"""Compression while the model writes (``decode_target``/``decode_ratio``, ``snapkv.decoding_cuts``): the cache
stays bounded by the target plus one interval, what is cut is freed, batched rows are cut each on its own real
tokens, ``generate`` and the harness's decode loop both cut, and the setting names itself (tag, label,
fingerprint, planner). kvpress parity is ``tests/test_decoding_parity.py``."""
import json

import pytest
import torch
from transformers import DynamicCache

import snapkv
from conftest import compose
from eval.runner import Runner
from snapkv.cache_state import state_of
from snapkv.memory import plan
from tiny_models import tiny_model

DECODING = dict(budget=None, ratio=0.0, decode_target=24, decode_interval=8, decode_buffer=4)


def decode(model, cache, first: int, steps: int, **kwargs) -> list[int]:
    tokens = [first]
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache, **kwargs).logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("method", ["knorm", "tova", "streamingllm", "keydiff", "snapkv", "expected_attention"])
def test_the_cache_never_holds_more_than_target_plus_interval_and_cuts_are_freed(method):
    model = tiny_model()
    fields = dict(DECODING, decode_interval=16, decode_buffer=16) if method == "snapkv" else DECODING
    if method == "snapkv":
        fields["window"] = 8
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = snapkv.build_config(method, **fields)
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        first = int(model(ids, cache=cache).logits[0, -1].argmax())
        tokens = [first]
        lengths = []
        for _ in range(60):
            tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1].argmax()))
            lengths.append(cache.layers[0].keys.shape[-2])
    interval = cfg.decode_interval
    assert max(lengths) <= max(40, cfg.decode_target) + interval
    state = state_of(cache)
    assert state.decoding_cuts == (60 // interval) * model.config.num_hidden_layers
    assert cache.layers[0].keys.shape[-2] == cfg.decode_target + 60 % interval
    assert cache.get_seq_length() == 40 + 60  # positions keep counting every token seen
    held = snapkv.kept_positions(cache)[0][0][0]
    assert len(held) == cfg.decode_target and int(held.max()) < 40 + 60


def test_generate_cuts_while_it_writes_and_matches_the_token_by_token_loop():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    cfg = snapkv.build_config("knorm", **DECODING)
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        out = model.generate(ids, cache=cache, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        generated = out[0, 30:].tolist()
        assert state_of(cache).decoding_cuts > 0
        loop_cache = DynamicCache(config=model.config)
        first = int(model(ids, cache=loop_cache).logits[0, -1].argmax())
        assert decode(model, loop_cache, first, 39) == generated


def test_each_row_of_a_padded_batch_is_cut_on_its_own_real_tokens():
    model = tiny_model()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (30, 18)]
    cfg = snapkv.build_config("knorm", **DECODING)
    solo = []
    with torch.no_grad(), snapkv.compress(model, cfg):
        for p in prompts:
            cache = DynamicCache(config=model.config)
            first = int(model(p[None], cache=cache).logits[0, -1].argmax())
            solo.append((decode(model, cache, first, 20), snapkv.kept_positions(cache)[1][0]))
        width = 30
        ids = torch.zeros(2, width, dtype=torch.long)
        mask = torch.zeros(2, width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
        cache = DynamicCache(config=model.config)
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache).logits
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(20):
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            out = model(tokens[-1][:, None], cache=cache, attention_mask=mask,
                        position_ids=mask.sum(dim=1, keepdim=True) - 1)
            tokens.append(out.logits[:, -1].argmax(-1))
    batched = torch.stack(tokens, dim=1).tolist()
    held = snapkv.kept_positions(cache)[1]
    for row in range(2):
        assert batched[row] == solo[row][0]
        for head in range(len(held[row])):
            assert held[row][head].tolist() == solo[row][1][head].tolist()


def test_the_setting_names_itself_and_bad_values_get_one_line():
    cfg = snapkv.build_config("knorm", **DECODING)
    assert cfg.label() == "Knorm ratio 0 (decoding 24 every 8)"
    assert snapkv.build_config("knorm").label() == "Knorm 1024"
    node = compose("lines", ["compressor=knorm", "compressor.decode_target=512", "compressor.decode_interval=128"])
    assert node.compressor.tag == "knorm-b1024-dt512-di128-db256"
    assert compose("lines", ["compressor=knorm"]).compressor.tag == "knorm-b1024"
    with pytest.raises(snapkv.InputError, match="decode_target: adakv cannot cut the cache while decoding"):
        snapkv.build_config("adakv", decode_target=64)
    with pytest.raises(snapkv.InputError, match="decode_target=16: as snapkv's budget while decoding"):
        snapkv.build_config("snapkv", decode_target=16)
    with pytest.raises(snapkv.InputError, match="set at most one"):
        snapkv.build_config("knorm", decode_target=16, decode_ratio=0.5)
    with pytest.raises(snapkv.InputError, match=r"decode_ratio=1\.5"):
        snapkv.build_config("knorm", decode_ratio=1.5)


def test_a_method_reading_more_queries_than_the_buffer_holds_says_so():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = snapkv.build_config("snapkv", window=8, **DECODING)  # interval 8, buffer 4: a cut sees 5 tokens
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        first = int(model(ids, cache=cache).logits[0, -1].argmax())
        with pytest.raises(snapkv.InputError, match="reads the last 8 decoded tokens' queries"):
            decode(model, cache, first, 10)


def test_the_planner_bounds_the_decoding_cache_by_target_plus_interval():
    model = tiny_model()
    full = plan(model.config, 1000, None, decode_tokens=4096, dtype="float32", device="cpu")
    cut = plan(model.config, 1000, snapkv.build_config("knorm", **dict(DECODING, decode_target=512,
                                                                      decode_interval=128)),
               decode_tokens=4096, dtype="float32", device="cpu")
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 4 * (
        model.config.hidden_size // model.config.num_attention_heads)
    assert full["decode_peak_bytes"] - cut["decode_peak_bytes"] >= (1000 + 4096 - 1128 - 512) * per_token


def test_a_record_carries_the_cuts_and_the_cache_it_ended_with():
    model = tiny_model()
    runner = Runner(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    cut, full = runner.generate_shared(ids, [snapkv.build_config("knorm", **DECODING), snapkv.FullKV()], 30,
                                       together=True)
    assert cut.cost()["decode_cuts"] == 3 * model.config.num_hidden_layers
    assert 0 < cut.cost()["final_kv_bytes"] < cut.cost()["kv_cache_bytes"] + 30 * runner.token_kv_bytes
    assert "decode_cuts" not in full.cost()
    json.dumps(cut.cost())
