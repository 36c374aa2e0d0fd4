"""The attention-weights stage (``Method.needs_attention_weights``, ``LayerContext.attention_weights()``):
with eager attention a method gets the module's own weights; with sdpa the hooks compute them again, bit for
bit what eager computes from the same queries and keys, once per layer for every setting asking, causal and
blind to padding."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import snapkv
import snapkv.hooks
from snapkv.hooks import eager_attention_weights
from snapkv.prompt_scores import WholePromptMethod

TINY = Path(__file__).resolve().parent / "fixtures" / "kvpress" / "tiny_gqa"  # 2 layers, 4 query heads, 2 KV heads
SEEN: dict = {}


@dataclass
class Spy(WholePromptMethod):
    """Not registered: keeps what ``ctx.attention_weights()`` gave and eager's recomputation beside it."""

    method = "spy_attention_weights"
    needs_attention_weights = True

    def score(self, ctx):
        weights = ctx.attention_weights()
        again = eager_attention_weights(ctx.queries(ctx.hidden_states.shape[1]), ctx.keys, ctx.pad_mask,
                                        ctx.scaling)
        SEEN[(ctx.attn.config._attn_implementation, ctx.layer_idx)] = (weights, again)
        return weights.sum(2)[:, ::2]

    def compression_bytes(self, shape, length, batch, nbytes):
        return 1


def tiny(attention: str):
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation=attention).eval()


def ids(n: int = 120, seed: int = 1):
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, cfgs, tokens, **kwargs):
    with torch.no_grad(), snapkv.compress(model, cfgs) as session:
        model(tokens, cache=DynamicCache(config=model.config), use_cache=True, **kwargs)
        return session.caches


def test_eager_gives_its_own_weights_and_the_recomputation_equals_them_bit_for_bit():
    SEEN.clear()
    tokens = ids()
    prefill(tiny("eager"), [Spy(budget=None, ratio=0.5)], tokens)
    prefill(tiny("sdpa"), [Spy(budget=None, ratio=0.5)], tokens)
    for layer in (0, 1):
        own, again = SEEN[("eager", layer)]
        assert own.shape == (1, 4, tokens.shape[1], tokens.shape[1])
        assert torch.equal(own, again)  # eager's own weights, and ours from the same queries and keys
        recomputed, _ = SEEN[("sdpa", layer)]
        assert torch.allclose(recomputed.sum(-1), torch.ones(()), atol=1e-5)
        assert not recomputed.triu(1).any()  # causal: no query sees a later key
    # the first layer's queries and keys are the same under both: the same weights, bit for bit
    assert torch.equal(SEEN[("eager", 0)][0], SEEN[("sdpa", 0)][0])


def test_the_weights_are_computed_once_per_layer_for_every_setting(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return eager_attention_weights(*args, **kwargs)
    monkeypatch.setattr(snapkv.hooks, "eager_attention_weights", counted)
    cfgs = [snapkv.build_config("observed_attention", budget=None, ratio=r) for r in (0.25, 0.5, 0.75)]
    shared = prefill(tiny("sdpa"), cfgs, ids())
    assert len(calls) == 2  # one per layer, for three settings
    for cfg, cache in zip(cfgs, shared):
        alone = prefill(tiny("sdpa"), [cfg], ids())[0]
        for got, want in zip(snapkv.kept_positions(cache), snapkv.kept_positions(alone)):
            assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))


def test_a_method_not_asking_gets_no_weights_kept(monkeypatch):
    monkeypatch.setattr(snapkv.hooks, "eager_attention_weights", lambda *a, **k: pytest.fail("computed"))
    prefill(tiny("sdpa"), [snapkv.build_config("knorm", budget=None, ratio=0.5)], ids())
    session = snapkv.hooks.CompressionSession(tiny("sdpa"), snapkv.build_config("knorm", budget=None, ratio=0.5))
    assert not session._keeps_weights and not session._keeps_queries


def test_a_left_padded_row_keeps_what_it_keeps_alone():
    """The weights are blind to padded keys, and observed attention scores each row on its real tokens."""
    model = tiny("sdpa")
    short, long = ids(90, seed=2), ids(120, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 30, dtype=torch.long), short], dim=1), long])
    mask = torch.ones(2, 120, dtype=torch.long)
    mask[0, :30] = 0
    cfg = snapkv.build_config("observed_attention", budget=40)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = snapkv.kept_positions(prefill(model, [cfg], batch, attention_mask=mask, position_ids=positions)[0])
    for row, tokens in enumerate((short, long)):  # kept_positions counts each row from its first real token
        alone = snapkv.kept_positions(prefill(model, [cfg], tokens)[0])
        for layer in range(2):
            for head in range(2):
                assert torch.equal(batched[layer][row][head], alone[layer][0][head]), (row, layer, head)


def test_an_eager_model_computes_nothing_again(monkeypatch):
    """Observed attention on an eager model reads the module's weights, and keeps what it keeps on sdpa here."""
    cfg = snapkv.build_config("observed_attention", budget=None, ratio=0.5)
    on_sdpa = snapkv.kept_positions(prefill(tiny("sdpa"), [cfg], ids())[0])
    monkeypatch.setattr(snapkv.hooks, "eager_attention_weights", lambda *a, **k: pytest.fail("computed again"))
    on_eager = snapkv.kept_positions(prefill(tiny("eager"), [cfg], ids())[0])
    for got, want in zip(on_eager, on_sdpa):
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
