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
from snapkv.decoding_cuts import DecodingBuffer, cut_heads
from snapkv.hooks import LayerContext
from snapkv.memory import plan
from snapkv.ragged import RaggedLayer, pack_heads, room_after
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


def batch_against_rows(model, cfg, lengths: tuple, steps: int, seed: int):
    """Prompts of ``lengths`` decoded ``steps`` tokens each alone and as one left-padded batch under ``cfg``: the
    batch's cache, and per row (batched tokens, alone tokens, batched kept positions, alone kept positions) of
    layer 1."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    solo = []
    with torch.no_grad(), snapkv.compress(model, cfg):
        for p in prompts:
            cache = DynamicCache(config=model.config)
            first = int(model(p[None], cache=cache).logits[0, -1].argmax())
            solo.append((decode(model, cache, first, steps), snapkv.kept_positions(cache)[1][0]))
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
        cache = DynamicCache(config=model.config)
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache).logits
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            out = model(tokens[-1][:, None], cache=cache, attention_mask=mask,
                        position_ids=mask.sum(dim=1, keepdim=True) - 1)
            tokens.append(out.logits[:, -1].argmax(-1))
    batched, held = torch.stack(tokens, dim=1).tolist(), snapkv.kept_positions(cache)[1]
    return cache, [(batched[row], solo[row][0], [h.tolist() for h in held[row]], [h.tolist() for h in solo[row][1]])
                   for row in range(len(prompts))]


def test_each_row_of_a_padded_batch_is_cut_on_its_own_real_tokens():
    _, rows = batch_against_rows(tiny_model(), snapkv.build_config("knorm", **DECODING), (30, 18), 20, seed=2)
    for batched, alone, held, held_alone in rows:
        assert batched == alone and held == held_alone


def test_the_setting_names_itself_and_bad_values_get_one_line():
    cfg = snapkv.build_config("knorm", **DECODING)
    assert cfg.label() == "Knorm ratio 0 (decoding 24 every 8)"
    assert snapkv.build_config("knorm").label() == "Knorm 1024"
    node = compose("lines", ["compressor=knorm", "compressor.decode_target=512", "compressor.decode_interval=128"])
    assert node.compressor.tag == "knorm-b1024-dt512-di128-db256"
    assert compose("lines", ["compressor=knorm"]).compressor.tag == "knorm-b1024"
    with pytest.raises(snapkv.InputError, match="decode_target: adakv cannot cut the cache while decoding "
                                                "\\(allocation=authors"):
        snapkv.build_config("adakv", allocation="authors", decode_target=128)
    with pytest.raises(snapkv.InputError, match="decode_target: kvzip cannot cut the cache while decoding"):
        snapkv.build_config("kvzip", decode_target=128)
    with pytest.raises(snapkv.InputError, match="decode_target=16: as snapkv's budget while decoding"):
        snapkv.build_config("snapkv", decode_target=16)
    own = compose("lines", ["compressor=snapkv", "compressor.decode_target=512",
                            "compressor.decode_query_positions=own"])
    assert own.compressor.tag.endswith("-dt512-di512-db256-qpown")
    assert snapkv.build_config("knorm", decode_query_positions="own", **DECODING).label().endswith(
        "(decoding 24 every 8, queries at their own positions)")
    with pytest.raises(snapkv.InputError, match="decode_query_positions='mine'"):
        snapkv.build_config("knorm", decode_query_positions="mine", **DECODING)
    with pytest.raises(snapkv.InputError, match="set at most one"):
        snapkv.build_config("knorm", decode_target=16, decode_ratio=0.5)
    with pytest.raises(snapkv.InputError, match=r"decode_ratio=1\.5"):
        snapkv.build_config("knorm", decode_ratio=1.5)
    # a cut reads min(interval, buffer + 1) buffered tokens; ExpectedAttention skips its first n_sink of them
    with pytest.raises(snapkv.InputError, match=r"^decode_interval=512, decode_buffer=3: a cut while decoding reads 4"):
        snapkv.build_config("expected_attention", decode_target=64, decode_buffer=3)
    snapkv.build_config("expected_attention", decode_target=64, decode_buffer=4)  # 5 buffered tokens: one query


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


HEAD_ADAPTIVE = {"adakv": dict(method="adakv", window=8),
                 "adakv_expected_attention": dict(method="adakv", scorer="expected_attention", window=8),
                 "critical_adakv": dict(method="critical_adakv", window=8),
                 "adakv_after_a_prompt_cut": dict(method="adakv", scorer="knorm", window=8, budget=32, ratio=None)}


@pytest.mark.parametrize("name", sorted(HEAD_ADAPTIVE))
def test_a_head_adaptive_cut_while_decoding_keeps_target_times_heads_and_frees_the_rest(name):
    model = tiny_model()
    heads, target, interval = model.config.num_key_value_heads, 24, 16
    ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    cfg = snapkv.build_config(**dict(DECODING, decode_interval=interval, decode_buffer=16, **HEAD_ADAPTIVE[name]))
    counts = set()
    with torch.no_grad(), snapkv.compress(model, cfg):
        cache = DynamicCache(config=model.config)
        tokens = [int(model(ids, cache=cache).logits[0, -1].argmax())]
        before, seen = snapkv.kept_positions(cache), 60
        for step in range(1, 51):
            tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1].argmax()))
            if step % interval == 0:  # every layer was just cut: target x heads slots, the rest freed
                after = snapkv.kept_positions(cache)
                for idx, layer in enumerate(cache.layers):
                    assert isinstance(layer, RaggedLayer) and layer.filled == 0
                    assert sum(layer.prompt_counts[0]) == heads * target == layer.keys.shape[1]
                    counts.add(tuple(layer.prompt_counts[0]))
                    for head in range(heads):  # each head keeps what it held: its kept slots and the tokens since
                        held = set(before[idx][0][head].tolist()) | set(range(seen, 60 + step))
                        assert set(after[idx][0][head].tolist()) <= held
                before, seen = after, 60 + step
    state = state_of(cache)
    assert state.decoding_cuts == 3 * model.config.num_hidden_layers
    assert len(counts) > 1 or any(len(set(c)) > 1 for c in counts)  # the heads' counts differ somewhere
    layer = cache.layers[0]
    assert layer.keys.shape[1] <= heads * (target + room_after(2))
    assert cache.get_seq_length() == 60 + 50
    for positions in snapkv.kept_positions(cache)[0][0]:
        assert len(set(positions.tolist())) == len(positions) and int(positions.max()) < 60 + 48


@pytest.mark.parametrize("fields", [dict(method="adakv", window=8), dict(method="critical_adakv", window=8),
                                    dict(method="adakv", scorer="expected_attention", window=8),
                                    dict(method="adakv", scorer="streamingllm", window=8)])
def test_a_ragged_layer_is_scored_head_by_head_as_the_same_slots_in_a_uniform_layer(fields):
    """Every head of a ragged layer holding the same slots: its cut equals the uniform layer's (the scorer's
    window, sinks and pooling read each head's segment as they read a whole cache)."""
    model = tiny_model()
    config = model.config
    gen = torch.Generator().manual_seed(4)
    length, heads, target = 50, config.num_key_value_heads, 20
    d = config.hidden_size // config.num_attention_heads
    keys, values = torch.randn(1, heads, length, d, generator=gen), torch.randn(1, heads, length, d, generator=gen)
    hidden = torch.randn(1, 16, config.hidden_size, generator=gen)
    rotary = model.model.rotary_emb
    cos, sin = rotary(hidden, torch.arange(length - 16, length)[None])
    cfg = snapkv.build_config(**dict(DECODING, decode_target=target, decode_interval=16, decode_buffer=16, **fields))
    cut = cfg.for_decoding(target)
    attn = model.model.layers[0].self_attn

    def context(row, k, v):
        return LayerContext(attn, hidden[row:row + 1], (cos, sin), k, v, None, 0, config.num_hidden_layers,
                            rotary=rotary, decoding=cfg)

    with torch.no_grad():
        kept, valid = cut.select(context(0, keys, values), target, min(cut.recent_window(0, 2, length), target))
        every = torch.arange(length).expand(1, heads, length)
        layer = RaggedLayer(*pack_heads(keys, values, every, torch.ones_like(every, dtype=torch.bool)))
        recut = cut_heads(cut, layer, context, target, length)
    for head, positions in enumerate(recut.kept_positions()[0]):
        assert positions.tolist() == kept[0, head][valid[0, head]].sort().values.tolist()


def test_each_row_of_a_padded_batch_is_cut_head_by_head_on_its_own_tokens():
    model = tiny_model()
    cfg = snapkv.build_config(**dict(DECODING, decode_interval=12, decode_buffer=12, method="adakv", window=8))
    cache, rows = batch_against_rows(model, cfg, (40, 26), 30, seed=5)
    assert state_of(cache).decoding_cuts == 2 * model.config.num_hidden_layers
    for batched, alone, held, held_alone in rows:
        assert batched == alone and held == held_alone


def test_the_planner_bounds_a_head_adaptive_decoding_cache_by_its_room():
    model = tiny_model()
    fields = dict(DECODING, decode_target=512, decode_interval=128)
    full = plan(model.config, 1000, None, decode_tokens=4096, dtype="float32", device="cpu")
    uniform = plan(model.config, 1000, snapkv.build_config("knorm", **fields), decode_tokens=4096, dtype="float32",
                   device="cpu")
    ragged = plan(model.config, 1000, snapkv.build_config("adakv", **fields), decode_tokens=4096, dtype="float32",
                  device="cpu")
    assert uniform["decode_peak_bytes"] < ragged["decode_peak_bytes"] < full["decode_peak_bytes"]


def test_the_buffered_queries_sit_at_the_current_position_as_kvpress_reads_them_or_at_their_own():
    buffer = DecodingBuffer()
    for position in range(3):
        table = torch.full((1, 1, 4), float(position))
        buffer.add(torch.zeros(2, 1, 8), (table, -table))
    hidden, (cos, sin) = buffer.tokens("current")
    assert hidden.shape == (2, 3, 8) and cos.shape == sin.shape == (2, 3, 4)
    assert bool((cos == 2).all()) and bool((sin == -2).all())
    _, (cos, _) = buffer.tokens("own")
    assert cos[0, :, 0].tolist() == [0.0, 1.0, 2.0]


def test_a_head_holding_fewer_slots_than_its_safeguard_keeps_them_and_nothing_it_does_not_hold():
    from snapkv.head_budgets import adakv_keep, critical_adakv_keep
    model = tiny_model()
    gen = torch.Generator().manual_seed(6)
    scores = torch.rand(1, 2, 10, generator=gen)
    held = torch.ones(1, 2, 10, dtype=torch.bool)
    held[0, 1, 2:] = False  # head 1 holds 2 slots, under the safeguard's int(5 * 0.8) = 4
    scores = scores.masked_fill(~held, float("-inf"))
    values = torch.randn(1, 2, 10, model.config.hidden_size // model.config.num_attention_heads, generator=gen)
    values = values.masked_fill(~held[..., None], 0.0)  # padded values: zero norms
    attn = model.model.layers[0].self_attn
    for keep in (adakv_keep(scores.clone(), 5, 0.8, held),
                 critical_adakv_keep(scores.clone(), 5, 0.8, values, attn, 1e-4, 0.5, held)):
        assert not bool((keep & ~held).any())
        assert int(keep.sum()) == 2 * 5 and keep[0, 1, :2].all()
