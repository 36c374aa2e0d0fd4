"""Each decoder-only family the compressor takes is read exactly as the model attends, or refused in one line.

A tiny random model of each family (eager attention, 3 layers, 4 query and 2 KV heads): SnapKV's kept positions
on every layer equal the selection the official ``update_kv`` makes from the model's own attention weights
(``output_attentions``: the window's rows summed, max-pooled, top-k per query head), up to a tie at the cut
(``tests/parity.py``), in one chunk and with the chunked prefill (``snapkv.prefill``) in chunks of 32. A family
whose attention the compressor cannot read exactly is refused before any prefill, with one line naming why (never
a silently wrong selection)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import snapkv
from parity import compare_kept, kept_array
from snapkv.prefill import PREFILL_CHUNK

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
READ_EXACTLY = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=16)),                      # q/k norms per head
    "granite": ("granite", dict(attention_multiplier=0.3)),     # its own attention scaling
    "cohere": ("cohere", {}),                                   # interleaved RoPE (Command-R)
    "cohere-qk-norm": ("cohere", dict(use_qk_norm=True)),       # Command-R+
    "olmo": ("olmo", {}),
    "starcoder2": ("starcoder2", dict(sliding_window=None)),
    "smollm3-every-layer-rotated": ("smollm3", dict(no_rope_layer_interval=8)),
}
REFUSED = {
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2), "applies no RoPE"),
    "cohere2": ("cohere2", dict(layer_types=["full_attention"] * 3, sliding_window=None), "applies no RoPE"),
    "olmo2": ("olmo2", {}, "q_norm normalises the whole"),
    "phi3": ("phi3", {}, "differs from the Llama family"),
    "gpt_neox": ("gpt_neox", {}, "differs from the Llama family"),
    "deepseek_v3": ("deepseek_v3", {}, "differs from the Llama family"),
    "falcon": ("falcon", {}, "no decoder layers"),
    "gemma2": ("gemma2", {}, "sliding_window"),
}
WINDOW, BUDGET, KERNEL = 8, 40, 5


def build(model_type: str, extra: dict):
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random init attends nearly uniformly: sharpen it so the selection means something
        for layer in getattr(model.base_model, "layers", []):
            for name in ("q_proj", "k_proj"):
                projection = getattr(getattr(layer, "self_attn", None), name, None)
                if projection is not None:
                    projection.weight.mul_(4.0)
    return model


def selection_from_the_models_own_weights(model, ids) -> np.ndarray:
    """``[layers, query heads, L]``: the official SnapKV selection (``update_kv``) on the model's attention weights."""
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    length = ids.shape[1]
    kept = np.zeros((len(weights), weights[0].shape[1], length), dtype=bool)
    for layer, w in enumerate(weights):
        votes = w[:, :, -WINDOW:, :-WINDOW].float().sum(dim=-2)
        pooled = F.max_pool1d(votes, kernel_size=KERNEL, padding=KERNEL // 2, stride=1)
        top = pooled.topk(BUDGET - WINDOW, dim=-1).indices[0]
        kept[layer, np.arange(kept.shape[1])[:, None], top.numpy()] = True
        kept[layer, :, -WINDOW:] = True
    return kept


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 32], ids=["one-chunk", "chunks-of-32"])
@pytest.mark.parametrize("family", sorted(READ_EXACTLY))
def test_a_family_is_read_as_the_model_attends(family, chunk):
    model_type, extra = READ_EXACTLY[family]
    model = build(model_type, extra)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    want = selection_from_the_models_own_weights(model, ids)
    cfg = snapkv.SnapKV(budget=BUDGET, window=WINDOW, kernel=KERNEL, pooling="maxpool", gqa="repeat")
    with torch.no_grad(), snapkv.compress(model, cfg, record_scores=True, prefill_chunk=chunk) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        cache = session.caches[0]
    comparison = compare_kept(kept_array(cache, ids.shape[1]), want, snapkv.ranking_scores(cache),
                              label=f"family {family}")
    assert comparison.equal, comparison.describe(family)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_read_otherwise_is_refused_in_one_line(family):
    model_type, extra, why = REFUSED[family]
    model = build(model_type, extra)
    with pytest.raises(ValueError, match=f"^model_type='{model_type}'.*{why}") as refused:
        snapkv.compress(model, snapkv.SnapKV(budget=BUDGET, window=WINDOW)).__enter__()
    assert "\n" not in str(refused.value)
