"""Ragged storage for head-adaptive caches (AdaKV, CriticalAdaKV, KVzip): each KV head holds only the
positions it kept, and attention reads only those.

Layout of one layer (``RaggedLayer``): per batch row, one buffer ``[capacity, head_dim]`` of keys (and
one of values) in which each KV head owns a contiguous segment: the prompt positions it kept
(ascending), then the tokens appended after the cut (decoded tokens, a later turn such as the question
of ``query_aware=false``), which every head keeps, then room for more. ``keys``/``values`` are these
buffers, ``[rows, capacity, head_dim]``; ``prompt_counts[row][head]`` says how many prompt slots a
segment holds and ``positions`` ``[rows, slots]`` (int32) which prompt position each holds, head after
head (``snapkv.kept_positions``). A row keeping fewer slots in all than the batch's longest row ends
with unused slots.

The buffers are cut exactly at the prefill (``kv_heads x`` the average a head keeps: AdaKV keeps exactly
``kv_heads * budget`` a row, so the bytes equal a uniform method's at the same average budget, and the
index equals a uniform cache's 4 bytes a slot). The first appended token gives each head room for 16
tokens; when the room runs out it doubles (the layer is copied once into the larger buffer), so a
decoding step writes its token in place and never copies the layer, where transformers' own layer
concatenates its whole cache at every step.

Attention (``headwise_attention``) reads each head's segment as a view, with no copy and no padding:

- on a CPU, and for any pass of several tokens: one attention call per row and KV head over its segment
  (its query heads together), with torch's sdpa kernel, or the eager arithmetic (float32 softmax) for a
  model loaded with ``attn_implementation="eager"``;
- on an accelerator, one token a row: every query head of a row against the row's whole buffer in one
  product, the slots outside its head's segment masked (``kv_heads`` times the scores a per-head product
  computes, a few MFLOP, in a handful of kernels instead of a launch per head).

A model loaded with ``flash_attention_2`` runs the same paths (its kernels take one key length per head
group, which a ragged layer does not have).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .architectures import AttentionForm
from .errors import InputError
from .select import attention_softmax, model_logits

HEADWISE_ATTENTION = "snapkv_headwise"
FIRST_ROOM = 16  # tokens of room each head gets at the first appended token


def room_after(tokens: int) -> int:
    """The room each head's segment has after ``tokens`` tokens were appended one at a time (the memory
    planner's decoding term)."""
    room = 0
    for filled in range(tokens):
        if filled + 1 > room:
            room = max(FIRST_ROOM, 2 * (filled + 1))
    return room


def pack_heads(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor,
               held: torch.Tensor | None = None):
    """``keys``/``values`` ``[rows, heads, length, d]`` and a head-adaptive selection (``kept`` ``[rows,
    heads, n]`` slots, each head's ``valid`` ones first; ``held``: the prompt position of each, default
    ``kept``) to ``(keys, values, counts, positions)`` of a ``RaggedLayer``: gathered straight from the
    layer, never through a copy padded to the longest head."""
    rows, heads, length, d = keys.shape
    flat_valid = valid.reshape(rows, -1)
    slots = int(flat_valid.sum(dim=1).max())
    # head-major order, each head's kept positions in order: the valid entries, first, stably
    order = torch.sort((~flat_valid).to(torch.uint8), dim=1, stable=True).indices[:, :slots]
    head = torch.div(order, kept.shape[-1], rounding_mode="floor")
    slot = kept.reshape(rows, -1).to(torch.int64).gather(1, order)
    position = slot if held is None else held.reshape(rows, -1).gather(1, order)
    index = (head * length + slot)[..., None].expand(-1, -1, d)
    packed_keys = keys.reshape(rows, heads * length, d).gather(1, index)
    packed_values = values.reshape(rows, heads * length, d).gather(1, index)
    return packed_keys, packed_values, valid.sum(dim=-1), position.to(torch.int32)


class RaggedLayer(DynamicLayer):
    """One layer of a head-adaptive cache: per row, each KV head's kept prompt slots and the tokens
    appended since, in a segment of its own. See the module's docstring."""

    snapkv_layer = True    # a layer the compression hooks accept in a cache
    attends_itself = True  # the hooks route its attention to ``headwise_attention``

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.positions = keys, values, positions
        self.prompt_counts: list[list[int]] = counts.tolist()
        self.kv_heads = counts.shape[1]
        self.room = 0     # slots each segment has for appended tokens
        self.filled = 0   # tokens appended to every segment
        self._place()

    def _place(self) -> None:
        """Where each segment starts (host lists, for views; and on the device) and where its next token
        goes (on the device)."""
        self.starts = []
        for counts in self.prompt_counts:
            start, row = 0, []
            for count in counts:
                row.append(start)
                start += count + self.room
            self.starts.append(row)
        self._starts = torch.tensor(self.starts, device=self.keys.device)
        self._next = self._starts + torch.tensor(self.prompt_counts, device=self.keys.device)

    def _capacity(self) -> int:
        return max(sum(counts) for counts in self.prompt_counts) + self.kv_heads * self.room

    def _grow(self, room: int) -> None:
        """Give every segment ``room`` slots for appended tokens: one copy of the layer."""
        old_starts, old = self.starts, (self.keys, self.values)
        self.room = room
        self._place()
        rows, _, d = self.keys.shape
        fresh = [buffer.new_zeros(rows, self._capacity(), d) for buffer in old]
        for row, counts in enumerate(self.prompt_counts):
            for head, count in enumerate(counts):
                used = count + self.filled
                src, dst = old_starts[row][head], self.starts[row][head]
                for buffer, new in zip(old, fresh):
                    new[row, dst:dst + used] = buffer[row, src:src + used]
        self.keys, self.values = fresh

    def update(self, key_states, value_states, *args, **kwargs):
        rows, heads, new, d = key_states.shape
        if self.filled + new > self.room:
            self._grow(max(FIRST_ROOM, 2 * (self.filled + new)))
        steps = torch.arange(self.filled, self.filled + new, device=self.keys.device)
        index = (self._next[..., None] + steps).reshape(rows, heads * new, 1).expand(-1, -1, d)
        self.keys.scatter_(1, index, key_states.reshape(rows, heads * new, d))
        self.values.scatter_(1, index, value_states.reshape(rows, heads * new, d))
        self.filled += new
        return self.keys, self.values

    def segment(self, row: int, head: int) -> tuple[int, int]:
        """The slots ``[start, end)`` of a row's head: its prompt slots and the appended tokens."""
        start = self.starts[row][head]
        return start, start + self.prompt_counts[row][head] + self.filled

    def held_positions(self, row: int, head: int, consumed: int) -> torch.Tensor:
        """The position (padded coordinates) of each slot of a row's head, in slot order: its prompt slots, then the
        tokens appended since the layer was cut (the last ``filled`` of the ``consumed`` tokens the cache has seen)."""
        first = sum(self.prompt_counts[row][:head])
        kept = self.positions[row, first:first + self.prompt_counts[row][head]]
        appended = torch.arange(consumed - self.filled, consumed, dtype=kept.dtype, device=kept.device)
        return torch.cat([kept, appended])

    def kept_slots(self, keep: torch.Tensor, consumed: int) -> "RaggedLayer":
        """A new layer holding only the slots ``keep`` marks (``[rows, kv_heads, n]`` bool, slot ``i`` of each
        head's segment; False past its end), gathered straight from this layer's buffers, the kept tokens now
        each head's own (a cut while decoding, ``snapkv.decoding_cuts.cut_heads``)."""
        rows, _, d = self.keys.shape
        counts = keep.sum(dim=-1)
        slots = int(counts.sum(dim=-1).max())
        keys, values = self.keys.new_zeros(rows, slots, d), self.values.new_zeros(rows, slots, d)
        positions = torch.zeros(rows, slots, dtype=self.positions.dtype, device=self.positions.device)
        capacity = self.keys.shape[1]
        for row in range(rows):  # the row's buffer marked slot by slot, then one gather (one host sync a row)
            marked = torch.zeros(capacity, dtype=torch.bool, device=keep.device)
            held = torch.zeros(capacity, dtype=self.positions.dtype, device=self.positions.device)
            for head in range(self.kv_heads):
                start, end = self.segment(row, head)
                marked[start:end] = keep[row, head, :end - start]
                held[start:end] = self.held_positions(row, head, consumed)
            index = marked.nonzero().flatten()
            keys[row, :index.numel()] = self.keys[row, index]
            values[row, :index.numel()] = self.values[row, index]
            positions[row, :index.numel()] = held[index]
        return RaggedLayer(keys, values, counts, positions)

    def get_seq_length(self) -> int:
        return max(sum(counts) for counts in self.prompt_counts) // self.kv_heads + self.filled

    def kept_positions(self) -> list[list[torch.Tensor]]:
        """``[row][head]``: the prompt positions each head holds (in the prompt's padded coordinates)."""
        positions = self.positions.cpu()
        out = []
        for row, counts in enumerate(self.prompt_counts):
            ends = torch.tensor(counts).cumsum(0).tolist()
            out.append([positions[row, end - count:end] for end, count in zip(ends, counts)])
        return out

    def padded_bytes(self) -> int:
        """What the same layer would hold padded to its longest head (bytes of keys and values)."""
        rows, _, d = self.keys.shape
        longest = max(max(counts) for counts in self.prompt_counts)
        return 2 * rows * self.kv_heads * (longest + self.filled) * d * self.keys.element_size()

    def masked_bytes(self, prompt_length: int) -> int:
        """What kvpress's way holds for this layer: every prompt position of every head (the evicted ones
        masked), and the appended tokens (bytes of keys and values)."""
        rows, _, d = self.keys.shape
        return 2 * rows * self.kv_heads * (prompt_length + self.filled) * d * self.keys.element_size()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        chosen = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        self.keys, self.values, self.positions = self.keys[indices], self.values[indices], self.positions[indices]
        self.prompt_counts = [self.prompt_counts[i] for i in chosen]
        self._place()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens appended to every segment (transformers' ``crop(-n)``): their
        slots are written over by the next ones. Only appended tokens can go (one line otherwise)."""
        tokens = -tokens_to_remove
        if tokens_to_remove > 0 or tokens > self.filled:
            raise InputError(f"crop({tokens_to_remove}): a head-adaptive layer can drop only the {self.filled} tokens "
                             "appended since its cut")
        self.filled -= tokens


def headwise_attention(module, query, key, value, attention_mask, snapkv_layer: RaggedLayer = None,
                       snapkv_kernel: str = "sdpa", scaling: float | None = None, dropout: float = 0.0,
                       snapkv_visible: torch.Tensor | None = None, **kwargs):
    """Attention of ``query`` ``[rows, heads, q, d]`` over a cache layer of a layout of its own (the hooks route
    every layer with ``attends_itself`` here). A ``RaggedLayer`` (``key``/``value`` are its buffers): each query
    head over its KV head's segment, the pass's own ``q`` tokens (its last) causal among themselves;
    ``snapkv_kernel``: the model's attention ("eager": its arithmetic; else sdpa). Another layout attends as it
    stores (``layer.attend(query, form, visible)``: ``snapkv.channels``; ``snapkv_visible``: the real slots of
    a left-padded batch's kept padding). Returns ``([rows, q, heads, d], None)`` as transformers' attention
    functions do."""
    layer = snapkv_layer
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    sinks = kwargs.get("s_aux")
    form = AttentionForm(scale, kwargs.get("softcap") or None, None if sinks is None else sinks.detach())
    if not isinstance(layer, RaggedLayer):
        out = layer.attend(query, form, snapkv_visible)
    elif folds(query):
        out = folded_attention(layer, query, form)
    else:
        out = segment_attention(layer, query, form, snapkv_kernel == "eager")
    return out.transpose(1, 2).contiguous(), None


def folds(query: torch.Tensor) -> bool:
    """Whether a pass takes the folded path: one token a row, on an accelerator."""
    return query.shape[2] == 1 and query.device.type != "cpu"


def segment_attention(layer: RaggedLayer, query: torch.Tensor, form: AttentionForm, eager: bool) -> torch.Tensor:
    """``[rows, heads, q, d]``: one attention call per row and KV head, over views of its segment (the layer's
    soft-capping and sinks as its eager attention applies them)."""
    rows, heads, q, d = query.shape
    groups = heads // layer.kv_heads
    eager = eager or not form.plain
    out = []
    for row in range(rows):
        for head in range(layer.kv_heads):
            start, end = layer.segment(row, head)
            keys = layer.keys[row:row + 1, None, start:end]
            values = layer.values[row:row + 1, None, start:end]
            part = query[row:row + 1, head * groups:(head + 1) * groups]
            mask = None
            if q > 1:  # query i (at end - q + i) sees the segment up to itself
                length = end - start
                mask = torch.arange(length, device=query.device)[None, :] <= \
                    torch.arange(length - q, length, device=query.device)[:, None]
            sinks = None if form.sinks is None else form.sinks[head * groups:(head + 1) * groups].view(1, -1, 1, 1)
            out.append(_attend(part, keys, values, mask, form, eager, sinks))
    return torch.cat(out, dim=1).view(rows, heads, q, d)


def _attend(query, keys, values, mask, form: AttentionForm, eager: bool, sinks=None) -> torch.Tensor:
    if not eager:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                                scale=form.scaling, enable_gqa=True)
    scores = model_logits(torch.matmul(query, keys.transpose(-1, -2)), query.shape[-1], form)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = attention_softmax(scores, sinks).to(query.dtype)
    return torch.matmul(probs, values)


def folded_attention(layer: RaggedLayer, query: torch.Tensor, form: AttentionForm) -> torch.Tensor:
    """``[rows, heads, 1, d]``: every query head of a row against the row's whole buffer in one product,
    the slots outside its head's segment masked (one token a row; the layer's soft-capping and sinks)."""
    rows, heads, _, d = query.shape
    groups = heads // layer.kv_heads
    capacity = layer.keys.shape[1]
    slot = torch.arange(capacity, device=query.device)
    ends = layer._next + layer.filled
    visible = (slot >= layer._starts[..., None]) & (slot < ends[..., None])   # [rows, kv_heads, capacity]
    scores = model_logits(torch.matmul(query.reshape(rows, heads, d), layer.keys.transpose(1, 2)), d, form)
    scores = scores.view(rows, layer.kv_heads, groups, capacity).masked_fill(~visible[:, :, None], float("-inf"))
    sinks = None if form.sinks is None else form.sinks.view(1, layer.kv_heads, groups, 1)
    probs = attention_softmax(scores, sinks).to(query.dtype).reshape(rows, heads, capacity)
    return torch.matmul(probs, layer.values).view(rows, heads, 1, d)


def storage_alternatives(cache, prompt_length: int) -> dict:
    """For a cache with layers of a layout of their own (``masked_bytes``: ragged, fewer key channels), the bytes
    of keys and values those layers would hold masked as kvpress keeps them (every key whole: the evicted ones
    masked, the pruned channels zeroed) and, for ragged layers, padded to their longest head (the cache's other
    layers as they are); empty for a cache without."""
    own = [layer for layer in cache.layers if hasattr(layer, "masked_bytes")]
    if not own:
        return {}
    other = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers
                if not hasattr(layer, "masked_bytes") and getattr(layer, "keys", None) is not None)
    out = {}
    if all(isinstance(layer, RaggedLayer) for layer in own):
        out["padded_kv_bytes"] = other + sum(layer.padded_bytes() for layer in own)
    out["masked_kv_bytes"] = other + sum(layer.masked_bytes(prompt_length) for layer in own)
    return out
