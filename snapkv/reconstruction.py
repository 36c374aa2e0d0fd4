"""KVzip's context reconstruction (Kim et al., arXiv 2505.23416), as kvpress 0.5.5's ``KVzipPress`` runs it.

After the prompt's prefill, with every layer's full KV in a cache, the model is asked to repeat its
context chunk by chunk ("Repeat the previous context exactly." then the chunk, in the chat frame of the
model's template); a position's importance per (layer, KV head) is the largest attention any query head
of its group pays it while the model reproduces the chunk it is in. Each replay pass appends its tokens
to the cache and the layer is put back to the context right after its attention, so only one layer's
replay copy is ever held. The scores are shared by every ratio of a prefill (one replay for all).
"""
from __future__ import annotations

import math

import torch

from .architectures import attention_of, module_call, output_projection, reading
from .errors import InputError
from .transformers_workarounds import filled_layer

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8  # tokens of the previous chunk that start the next request


def chat_frame(tokenizer) -> tuple[int, torch.Tensor]:
    """The chat template's prefix length (tokens before a user message's text) and the ids that close a
    user turn and open the answer (kvpress: a dummy message split at a separator; no template: ``"\\n"``)."""
    if tokenizer.chat_template is None:
        prefix, suffix = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix = text.split(separator)
        prefix = context.split(dummy)[0]
    prefix_length = tokenizer.encode(prefix, return_tensors="pt", add_special_tokens=False).shape[-1]
    return prefix_length, tokenizer.encode(suffix, return_tensors="pt", add_special_tokens=False)


def replay_requests(tokenizer, context_ids: torch.Tensor, prefix_length: int, suffix_ids: torch.Tensor,
                    chunk_size: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, ids)`` per chunk of the context after its prefix: the request to repeat positions
    ``[start, end)`` and the chunk itself."""
    context = context_ids[:, prefix_length:].cpu()
    chunks = [context[:, i:i + chunk_size] for i in range(0, context.shape[1], chunk_size)] or [context]
    requests, start = [], prefix_length
    for i, chunk in enumerate(chunks):
        if i == 0:
            ask = tokenizer.encode(REPEAT_FIRST, return_tensors="pt", add_special_tokens=False)
        else:
            ask = tokenizer.encode(REPEAT_NEXT, return_tensors="pt", add_special_tokens=False)
            ask = torch.cat([ask, chunks[i - 1][:, -PREVIOUS_TAIL:]], dim=1)
        requests.append((start, start + chunk.shape[1], torch.cat([ask, suffix_ids, chunk], dim=1)))
        start += chunk.shape[1]
    return requests


def _causal_tail(q_len: int, dtype, device) -> torch.Tensor:
    mask = torch.full((q_len, q_len), torch.finfo(dtype).min, device=device)
    steps = torch.arange(q_len, device=device)
    return mask.masked_fill_(steps < (steps + 1).view(q_len, 1), 0)


def chunk_scores(attn, hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position_embeddings,
                 start: int, end: int, n_sink: int, plus_normalization: bool) -> torch.Tensor:
    """``[b, kv_heads, end - start]``: the largest attention the replay's queries (``hidden``, the chunk's
    request) pay each position of ``[start, end)``; ``keys`` hold the context and the replay tokens."""
    b, q_len, _ = hidden.shape
    config, probe = attn.config, reading(attn)
    n_kv, head_dim = probe.kv_heads, probe.head_dim
    groups = probe.query_heads // n_kv
    queries = module_call(attn, hidden, position_embeddings).query
    queries = queries.view(b, n_kv, groups, q_len, head_dim)
    sink = min(n_sink, start)
    picked = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q_len:]], dim=2)
    weights = torch.matmul(queries, picked.unsqueeze(2).transpose(-2, -1).contiguous()) / math.sqrt(head_dim)
    weights[..., -q_len:, -q_len:] += _causal_tail(q_len, weights.dtype, weights.device)
    weights = torch.nn.functional.softmax(weights, dim=-1)
    if plus_normalization:  # KVzip+: divided by ||h|| per query, times ||v W_O|| per key
        weights = torch.einsum("b h g t i, b t -> b h g t i", weights, 1 / torch.norm(hidden, dim=-1))
        out_weight = output_projection(attn).weight.view(config.hidden_size, n_kv, groups, head_dim)
        picked_values = torch.cat([values[:, :, :sink], values[:, :, start:end], values[:, :, -q_len:]], dim=2)
        norms = torch.einsum("j h g i, b h t i -> b h g t j", out_weight, picked_values).norm(dim=-1)
        weights = torch.einsum("b h g i t, b h g t -> b h g i t", weights, norms)
    return weights[..., sink:sink + end - start].amax(dim=(-3, -2))


def reconstruction_scores(model, layers: list, decoder, full: list, context_ids: torch.Tensor, tokenizer,
                          n_sink: int, chunk_size: int, plus_normalization: bool,
                          keep_prefix: bool = False) -> torch.Tensor:
    """``[layers, b, kv_heads, L]`` in the model dtype: KVzip's importance of every context position,
    the first ``n_sink`` above all others (``keep_prefix``: the whole chat-template prefix, as the
    authors keep their system prompt). ``full``: each layer's ``(keys, values)`` of the context,
    left as they are. ``decoder``: the model's decoder stack (``model.model``), run without the LM head."""
    if tokenizer is None:
        raise InputError("kvzip: the model's tokenizer is needed for its reconstruction prompts; pass "
                         "snapkv.compress(model, cfg, tokenizer=...) (the runner passes its own)")
    b, n_kv, length, _ = full[0][0].shape
    if b != 1:
        raise InputError("kvzip: batch size 1 (KVzip scores one prompt, as kvpress's press does)")
    from transformers import DynamicCache
    prefix_length, suffix_ids = chat_frame(tokenizer)
    scores = torch.zeros(len(layers), b, n_kv, length, dtype=full[0][0].dtype, device=full[0][0].device)
    cache = DynamicCache(config=model.config)
    for idx, (keys, values) in enumerate(full):
        cache.layers[idx] = filled_layer(keys, values)
    span = {}

    def score_and_restore(module, args, kwargs, output):
        idx = module.layer_idx
        layer = cache.layers[idx]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        scores[idx][..., span["start"]:span["end"]] = chunk_scores(
            module, hidden, layer.keys, layer.values, kwargs["position_embeddings"], span["start"], span["end"],
            n_sink, plus_normalization)
        cache.layers[idx] = filled_layer(*full[idx])  # the context again: the replay tokens are dropped

    handles = [attention_of(layer).register_forward_hook(score_and_restore, with_kwargs=True) for layer in layers]
    try:
        for start, end, ids in replay_requests(tokenizer, context_ids, prefix_length, suffix_ids, chunk_size):
            span.update(start=start, end=end)
            decoder(input_ids=ids.to(context_ids.device), cache=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    scores[..., :max(n_sink, prefix_length if keep_prefix else 0)] = scores.amax() + 1.0
    return scores


def pruned_per_layer(scores: torch.Tensor, n_pruned: int, layerwise: int | None = None) -> list[int]:
    """How many of each layer's (head, position) pairs go: the ``n_pruned`` lowest over all layers at once
    (kvpress's default), or ``layerwise`` in every layer."""
    n_layers = scores.shape[0]
    if layerwise is not None:
        return [layerwise] * n_layers
    lowest = torch.topk(-scores.reshape(-1), n_pruned).indices
    return torch.bincount(lowest // scores[0].numel(), minlength=n_layers).tolist()


def kept_in_layer(layer_scores: torch.Tensor, n_pruned: int) -> torch.Tensor:
    """``[b, kv_heads, L]`` bool: the layer's ``n_pruned`` lowest (head, position) pairs evicted."""
    b, heads, length = layer_scores.shape
    lowest = torch.topk(-layer_scores.reshape(b, -1), n_pruned, dim=1).indices
    keep = torch.ones(b, heads * length, dtype=torch.bool, device=layer_scores.device)
    return keep.scatter_(1, lowest, False).view(b, heads, length)
