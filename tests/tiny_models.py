"""Tiny random transformers models built locally from configs (no network)."""
from __future__ import annotations

import tempfile
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)

ARCHITECTURES = {
    "llama-mha": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "mixtral": dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                    num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  use_sliding_window=False),
}
# Mixture-of-experts blocks (for chunked_mlp): every architecture above plus these.
MOE_ARCHITECTURES = {
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1),
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      use_sliding_window=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1),
}


def tiny_model(name: str = "llama-gqa", attn: str = "sdpa", seed: int = 0, **overrides):
    spec = {**COMMON, **{**ARCHITECTURES, **MOE_ARCHITECTURES}[name], **overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.config.name_or_path = tiny_tokenizer_dir()  # where a method finds the model's tokenizer (KVzip)
    # Random init is near-uniform attention; sharpen it so selection is meaningful.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model.eval()


@lru_cache(maxsize=1)
def tiny_tokenizer_dir() -> str:
    """A saved character tokenizer whose ids fit the tiny vocabulary (one id per ASCII character, no chat
    template), for methods that prompt the model themselves."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token=chr(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    folder = tempfile.mkdtemp(prefix="snapkv-tiny-tokenizer-")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder
