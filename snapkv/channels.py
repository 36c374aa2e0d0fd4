"""Storage with fewer key channels (``Method.stores_key_channels``, ThinK): each KV head keeps only some
channels of its prompt's keys, and the cache really holds fewer bytes.

kvpress's ``ThinKPress`` zeroes the pruned channels of the prompt's keys and keeps the cache's shape (no
memory gain). Here a layer (``KeyChannelLayer``) holds, per batch row and KV head:

- ``keys`` ``[rows, kv_heads, T, d_kept]``: the kept channels of every key it holds (the prompt's ``L``
  tokens, then the ``T - L`` tokens appended since: decoded tokens, a later turn such as the question of
  ``query_aware=false``);
- ``extra`` ``[rows, kv_heads, T - L, d - d_kept]``: the other channels of the appended tokens only, so a
  key appended after the prompt keeps every channel (as in kvpress, where only the prompt's keys are
  zeroed);
- ``channels`` / ``dropped`` ``[rows, kv_heads, d_kept]`` / ``[..., d - d_kept]`` (int64): which channels
  ``keys`` / ``extra`` hold, ascending;
- ``values`` ``[rows, kv_heads, T, d]`` whole.

So the prompt's keys take ``d_kept / d`` of their bytes, the values and the appended keys all of theirs,
plus ``d`` int64 indices per row and head (``stored_bytes``; ``eval.runner.kv_cache_bytes`` reads it).

Attention (``KeyChannelLayer.attend``, reached through ``snapkv.ragged.headwise_attention``): a query is
scored against every key on the kept channels, ``q[channels] . keys``, and against an appended key also on
the other channels, ``+ q[dropped] . extra``. Over the prompt that is exactly ``q . k_zeroed``, the score
kvpress's zeroed cache gives (the dropped channels contribute exact zeros there); over an appended key it is
``q . k``. Then the scaling, the causal mask among the pass's own tokens, the kept padding of a
left-padded batch, a float32 softmax cast to the model dtype and the values, as eager attention computes
them, whatever the model's attention (the sums run over fewer channels, so they round as another kernel
would: ``tests/test_think.py`` compares logits with zeroed keys to a tight tolerance and the tokens
exactly). A cache of such layers decodes alone (``snapkv.merge`` stacks layers of one key width) and takes
no later-turn compression.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .architectures import AttentionForm
from .errors import InputError
from .select import attention_softmax, model_logits


def _take(states: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``states`` ``[rows, heads, n, d]`` restricted to ``channels`` ``[rows, heads, c]`` of each head."""
    return states.gather(-1, channels[:, :, None, :].expand(-1, -1, states.shape[-2], -1))


def complement(channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[rows, heads, head_dim - c]``: the channels ``channels`` ``[rows, heads, c]`` leaves out, ascending."""
    rows, heads, kept = channels.shape
    left = torch.ones(rows, heads, head_dim, dtype=torch.bool, device=channels.device)
    left.scatter_(-1, channels, False)
    every = torch.arange(head_dim, device=channels.device).expand(rows, heads, head_dim)
    return every[left].view(rows, heads, head_dim - kept)


class KeyChannelLayer(DynamicLayer):
    """One layer whose prompt keys keep only some channels per (row, KV head). See the module's docstring."""

    snapkv_layer = True    # a layer the compression hooks accept in a cache
    attends_itself = True  # the hooks route its attention to ``attend`` (snapkv.ragged.headwise_attention)

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, channels: torch.Tensor):
        """``keys``/``values`` ``[rows, kv_heads, L, d]`` whole; ``channels`` ``[rows, kv_heads, d_kept]``: the
        channels each head keeps, ascending."""
        super().__init__()
        self.lazy_initialization(keys, values)
        self.head_dim = keys.shape[-1]
        self.channels = channels.to(torch.int64)
        self.dropped = complement(self.channels, self.head_dim)
        self.keys = _take(keys, self.channels)
        self.values = values
        self.extra = keys.new_empty(*keys.shape[:2], 0, self.dropped.shape[-1])

    @property
    def prompt_length(self) -> int:
        """Tokens whose keys keep only ``channels`` (the prompt's); the rest were appended whole."""
        return self.keys.shape[-2] - self.extra.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = torch.cat([self.keys, _take(key_states, self.channels)], dim=-2)
        self.extra = torch.cat([self.extra, _take(key_states, self.dropped)], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def attend(self, query: torch.Tensor, form: AttentionForm, visible: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, heads, q, d]``: attention of ``query`` (the pass's ``q`` tokens, the layer's last) over every
        token the layer holds, as the layer's ``form`` makes logits (scaling, soft-capping) and takes the softmax
        (sinks); ``visible`` ``[rows, T]``: which slots are real (kept padding), None: all."""
        rows, heads, q, d = query.shape
        kv_heads = self.channels.shape[1]
        groups = heads // kv_heads
        total, appended = self.keys.shape[-2], self.extra.shape[-2]
        grouped = query.reshape(rows, kv_heads, groups * q, d)  # the query heads of a KV head together
        scores = torch.matmul(_take(grouped, self.channels), self.keys.transpose(-1, -2))
        if appended:  # a key appended after the prompt: its other channels too
            scores[..., total - appended:] += torch.matmul(_take(grouped, self.dropped), self.extra.transpose(-1, -2))
        scores = model_logits(scores, d, form).view(rows, kv_heads, groups, q, total)
        lowest = torch.finfo(scores.dtype).min
        if q > 1:  # query i sits at slot total - q + i: it sees the slots up to itself
            later = torch.arange(total, device=query.device)[None, :] > \
                torch.arange(total - q, total, device=query.device)[:, None]
            scores = scores.masked_fill(later, lowest)
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None, None, None, -total:], lowest)
        sinks = None if form.sinks is None else form.sinks.view(1, kv_heads, groups, 1, 1)
        probs = attention_softmax(scores, sinks).to(query.dtype)
        out = torch.matmul(probs.reshape(rows, kv_heads, groups * q, total), self.values)
        return out.view(rows, heads, q, self.values.shape[-1])

    def stored_bytes(self) -> int:
        """Bytes the layer holds: keys (kept channels; the appended tokens' other channels), values, indices."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.extra, self.values, self.channels,
                                                          self.dropped))

    def masked_bytes(self, prompt_length: int) -> int:
        """What kvpress's way holds for this layer: every key whole (the pruned channels zeroed) and the values."""
        rows, heads, total, _ = self.values.shape
        return 2 * rows * heads * total * self.head_dim * self.values.element_size()

    def kept_channels(self) -> list[list[torch.Tensor]]:
        """``[row][head]``: the channels each head's prompt keys keep (ascending)."""
        channels = self.channels.cpu()
        return [[channels[row, head] for head in range(channels.shape[1])] for row in range(channels.shape[0])]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in ("keys", "extra", "values", "channels", "dropped"):
            setattr(self, name, getattr(self, name)[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name in ("keys", "extra", "values", "channels", "dropped"):
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` appended tokens (transformers' ``crop(-n)``): their kept channels, their
        other channels and their values. Only appended tokens can go (one line otherwise)."""
        tokens, appended = -tokens_to_remove, self.extra.shape[-2]
        if tokens_to_remove > 0 or tokens > appended:
            raise InputError(f"crop({tokens_to_remove}): a layer storing fewer key channels can drop only the "
                             f"{appended} tokens appended after its prompt")
        if tokens:
            self.keys, self.values = self.keys[:, :, :-tokens], self.values[:, :, :-tokens]
            self.extra = self.extra[:, :, :-tokens]


def kept_channels(cache) -> list[list[list[torch.Tensor]]]:
    """``[layer][batch row][KV head]``: a LongTensor of the key channels that head's prompt keys keep,
    ascending (every channel for a layer storing whole keys)."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, KeyChannelLayer):
            out.append(layer.kept_channels())
            continue
        rows, heads, _, d = layer.keys.shape
        out.append([[torch.arange(d) for _ in range(heads)] for _ in range(rows)])
    return out
