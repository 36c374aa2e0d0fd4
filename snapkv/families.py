"""The model families the compressor reads, what each needed, and how each is tested (docs/library.md's family table
is generated from ``FAMILIES``; ``tests/test_families.py`` runs every entry).

Nothing here is used to read a model: ``snapkv.architectures`` reads every family through its attention module's own
computation. This is the record of which families that was checked on, with the tiny configuration the test builds
(4 query and 2 KV heads, 3 layers; ``layers`` gives a hybrid model its layer types) and what made each one differ
from Llama."""
from __future__ import annotations

from dataclasses import dataclass, field

HYBRID = ("sliding_attention", "full_attention", "sliding_attention")  # a tiny hybrid model's layer types


@dataclass(frozen=True)
class Family:
    name: str                 # the test's id
    model_type: str
    example: str              # a checkpoint of the family
    differs: str              # what the compressor reads that Llama does not have
    tiny: dict = field(default_factory=dict)  # the test's configuration beyond the common one
    refused: str = ""         # why it is refused (the one-line error contains this), "" when read exactly
    limits: str = ""          # what is refused on it although it is read exactly (tested)

    @property
    def sliding(self) -> bool:
        """Whether the tiny model has sliding-window layers."""
        if "layer_types" in self.tiny:
            return "sliding_attention" in self.tiny["layer_types"]
        return bool(self.tiny.get("sliding_window"))


WINDOW = 48  # the tiny hybrid models' sliding window (prompts of 120 tokens)
SLIDING_LIMITS = "re-rotated keys (FINCH) and KVzip refused: sliding layers hold their window only"
ROPE_LIMITS = "re-rotated keys (FINCH) refused: its RoPE is not Llama's over every channel"

FAMILIES = (
    Family("llama", "llama", "meta-llama/Llama-3.1-8B-Instruct", "the reference layout (RoPE by rotate_half, GQA)"),
    Family("mistral", "mistral", "mistralai/Mistral-7B-Instruct-v0.3", "none (no sliding window since v0.2)",
           dict(sliding_window=None)),
    Family("mistral-sliding", "mistral", "mistralai/Mistral-7B-v0.1",
           "every layer slides (4,096): held as the model's sliding cache holds it, nothing compressed by default",
           dict(sliding_window=WINDOW), limits=SLIDING_LIMITS),
    Family("mixtral", "mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "MoE MLP (attention as Mistral)",
           dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
    Family("qwen2", "qwen2", "Qwen/Qwen2.5-7B-Instruct", "q/k/v biases"),
    Family("qwen3", "qwen3", "Qwen/Qwen3-8B", "q/k RMSNorm per head before RoPE", dict(head_dim=16)),
    Family("qwen3_moe", "qwen3_moe", "Qwen/Qwen3-30B-A3B", "as Qwen3, MoE MLP",
           dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Family("granite", "granite", "ibm-granite/granite-3.3-8b-instruct", "its attention multiplier as the scaling",
           dict(attention_multiplier=0.3)),
    Family("cohere", "cohere", "CohereForAI/c4ai-command-r-v01", "interleaved RoPE (Command-R, the paper's model)",
           limits=ROPE_LIMITS),
    Family("cohere-qk-norm", "cohere", "CohereForAI/c4ai-command-r-plus", "interleaved RoPE, q/k LayerNorm per head",
           dict(use_qk_norm=True), limits=ROPE_LIMITS),
    Family("cohere2", "cohere2", "CohereForAI/c4ai-command-r7b-12-2024",
           "sliding layers with RoPE, full-attention layers without RoPE",
           dict(sliding_window=WINDOW, layer_types=list(HYBRID)), limits=SLIDING_LIMITS),
    Family("cohere2-global", "cohere2", "CohereForAI/c4ai-command-r7b-12-2024",
           "its full-attention layers alone: no RoPE on any layer",
           dict(sliding_window=4096, layer_types=["full_attention"] * 3)),
    Family("olmo", "olmo", "allenai/OLMo-7B-0724-hf", "non-parametric LayerNorm"),
    Family("olmo2", "olmo2", "allenai/OLMo-2-1124-7B-Instruct", "q/k RMSNorm over the whole projection (H x d)"),
    Family("phi3", "phi3", "microsoft/Phi-3-mini-128k-instruct", "fused qkv_proj"),
    Family("phi3-partial-rotary", "phi3", "microsoft/Phi-4-mini-instruct", "fused qkv_proj, RoPE on 3/4 of each head",
           dict(partial_rotary_factor=0.75), limits=ROPE_LIMITS),
    Family("starcoder2", "starcoder2", "bigcode/starcoder2-7b", "biases, LayerNorm", dict(sliding_window=None)),
    Family("smollm3", "smollm3", "HuggingFaceTB/SmolLM3-3B", "no RoPE on every 4th layer (here every 2nd)",
           dict(no_rope_layer_interval=2)),
    Family("gemma", "gemma", "google/gemma-7b-it", "query_pre_attn_scalar as the scaling",
           dict(head_dim=16, query_pre_attn_scalar=24)),
    Family("gemma2", "gemma2", "google/gemma-2-9b-it",
           "tanh soft-capping of the attention logits, alternating sliding layers, query_pre_attn_scalar",
           dict(head_dim=16, sliding_window=WINDOW, layer_types=list(HYBRID), query_pre_attn_scalar=24,
                attn_logit_softcapping=2.0), limits=SLIDING_LIMITS),
    Family("gemma3", "gemma3_text", "google/gemma-3-12b-it",
           "q/k RMSNorm per head, sliding layers (5 of 6) with their own RoPE base, query_pre_attn_scalar",
           dict(head_dim=16, sliding_window=WINDOW, layer_types=list(HYBRID), query_pre_attn_scalar=24),
           limits=SLIDING_LIMITS),
    Family("gpt_oss", "gpt_oss", "openai/gpt-oss-20b",
           "attention sinks in the softmax, alternating sliding layers, MoE",
           dict(head_dim=16, sliding_window=WINDOW, layer_types=list(HYBRID), num_local_experts=4,
                num_experts_per_tok=2), limits=SLIDING_LIMITS),
    Family("glm", "glm", "THUDM/glm-4-9b-chat-hf", "partial rotary (half of each head, interleaved)",
           dict(head_dim=16), limits=ROPE_LIMITS),
    Family("helium", "helium", "kyutai/helium-1-preview-2b", "interleaved RoPE", dict(head_dim=16),
           limits=ROPE_LIMITS),
    Family("stablelm", "stablelm", "stabilityai/stablelm-2-1_6b", "partial rotary on a slice it cuts itself, LayerNorm",
           limits=ROPE_LIMITS + "; a method applying RoPE itself (Expected Attention, Compactor, DuoAttention) "
           "refused"),
    Family("gpt_neox", "gpt_neox", "EleutherAI/pythia-6.9b",
           "fused query_key_value, partial rotary, its attention module named `attention`, its cache `layer_past`",
           dict(num_key_value_heads=4), limits=ROPE_LIMITS),  # (multi-head: it has no key-value head count)
    Family("deepseek_v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3", "multi-head latent attention (MLA)",
           dict(num_key_value_heads=4), refused="multi-head latent attention"),
    Family("falcon", "falcon", "tiiuae/falcon-7b-instruct", "decoder layers at transformer.h",
           refused="no decoder layers"),
)
