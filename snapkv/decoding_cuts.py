"""Compression while the model writes: every ``decode_interval`` decoded tokens, each layer's cache is cut back
to ``decode_target`` tokens per head (or ``1 - decode_ratio`` of every token seen) by the setting's own ``select``.

Reference: kvpress 0.5.5 ``DecodingPress`` (and ``CompressionRatioDecodingPress``): after each decoding pass's
attention, a layer adds that pass's hidden states to a buffer and counts it; once the count reaches the interval,
the method scores the layer's whole cache (prompt and generated tokens) from the keys, the values and the
buffered hidden states, keeps the target, and the buffer and count start again; between cuts the buffer holds at
most ``decode_buffer`` tokens (at a cut, those and the current pass's). As there, a method ranking positions
keeps its slots in ``torch.topk``'s order (``ranked_slots``) and the buffered queries are rotated at the current
token's position (kvpress's scorers read the pass's position embeddings; ``decode_query_positions="own"``: each
at its own; the same for a method reading one query (TOVA) or none (Knorm, KeyDiff, StreamingLLM, Expected
Attention's pre-RoPE statistics)). What differs, all documented in ``docs/decoding.md``:

- the count is of tokens, kvpress's of passes (the same when decoding token by token, as both do);
- what is cut is freed: the layer holds the kept slots only. A head-adaptive method (AdaKV, CriticalAdaKV) cuts
  each head to its own count (``cut_heads``, a ``snapkv.ragged.RaggedLayer``), the layer's ``target`` x KV heads in
  all; kvpress's ``DecodingPress(AdaKVPress(...))`` masks instead, and a position it masked can come back at a later
  cut, its key overwritten by the mask's stand-in, so the two agree up to the second cut.

A left-padded batch cuts each row on its own real tokens: its padding scores below every real token, so a row
keeps padding only where it holds fewer real tokens than the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import InputError
from .ragged import RaggedLayer


@dataclass
class DecodingBuffer:
    """One layer's count of tokens decoded since its last cut, and their hidden states and rotary tables."""
    steps: int = 0
    hidden: list = field(default_factory=list)      # [b, q, hidden] per pass
    cos: list = field(default_factory=list)
    sin: list = field(default_factory=list)

    def add(self, hidden: torch.Tensor, position_embeddings) -> None:
        cos, sin = position_embeddings
        self.hidden.append(hidden.detach())
        self.cos.append(cos.expand(hidden.shape[0], *cos.shape[1:]))
        self.sin.append(sin.expand(hidden.shape[0], *sin.shape[1:]))
        self.steps += hidden.shape[1]

    def tokens(self, query_positions: str = "own") -> tuple[torch.Tensor, tuple]:
        """The buffered hidden states ``[b, n, hidden]`` and the ``(cos, sin)`` their queries are rotated with: each
        token's own (``"own"``), or the current token's for every one (``"current"``, as kvpress's scorers read the
        pass's position embeddings)."""
        hidden = torch.cat(self.hidden, dim=1)
        if query_positions == "current":
            n = hidden.shape[1]
            return hidden, (self.cos[-1][:, -1:].expand(-1, n, -1), self.sin[-1][:, -1:].expand(-1, n, -1))
        return hidden, (torch.cat(self.cos, dim=1), torch.cat(self.sin, dim=1))

    def drop_last(self, tokens: int) -> None:
        """Forget the last ``tokens`` buffered tokens (a verification pass's rejected drafts, ``CacheState.crop``)."""
        self.steps -= tokens
        while tokens:
            last = self.hidden[-1].shape[1]
            if last <= tokens:
                del self.hidden[-1], self.cos[-1], self.sin[-1]
                tokens -= last
            else:
                self.hidden[-1], self.cos[-1], self.sin[-1] = (part[:, :-tokens] for part in
                                                               (self.hidden[-1], self.cos[-1], self.sin[-1]))
                tokens = 0

    def restart(self) -> None:
        self.steps = 0
        self.hidden, self.cos, self.sin = [], [], []

    def trim(self, keep: int) -> None:
        """Hold at most the last ``keep`` tokens."""
        total = sum(part.shape[1] for part in self.hidden)
        while self.hidden and total > keep:
            over = total - keep
            first = self.hidden[0].shape[1]
            if first <= over:
                total -= first
                del self.hidden[0], self.cos[0], self.sin[0]
            else:
                self.hidden[0], self.cos[0], self.sin[0] = (part[:, over:] for part in
                                                            (self.hidden[0], self.cos[0], self.sin[0]))
                total -= over


def due(cfg, buffer: DecodingBuffer, by_pass: bool = True) -> bool:
    """Whether this pass cuts the layer (kvpress also cuts on a pass of at least ``target`` tokens; ``by_pass``
    False: by the count alone, as once a speculative pass's accepted tokens are known, ``CacheState.crop``)."""
    return buffer.steps >= cfg.decode_interval or (by_pass and cfg.decode_target is not None and
                                                   buffer.hidden[-1].shape[1] >= cfg.decode_target)


def check_buffer(cfg, rows: int, needed: int) -> None:
    """A method reading the queries of more decoded tokens than the buffer holds is refused in one line."""
    if needed > rows:
        raise InputError(f"decode_buffer={cfg.decode_buffer}, decode_interval={cfg.decode_interval}: {cfg.method} "
                         f"reads the last {needed} decoded tokens' queries at a cut, the buffer holds {rows}; raise "
                         "both to at least that")


def gather_slots(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots ``kept`` (``[b, kv_heads, n]``) of a layer's keys and values, as new tensors (the old freed)."""
    index = kept[..., None].expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, index), values.gather(2, index)


def ranked_slots(scores: torch.Tensor, target: int, real: torch.Tensor | None) -> torch.Tensor:
    """The ``target`` best slots per head ``[b, kv_heads, target]`` in the order ``torch.topk`` ranks them, as
    kvpress's ``ScorerPress`` leaves its cache (ties, and the rounding of sums over the cache, then fall as they
    do there, cut after cut). ``real`` ``[b, L]``: a padded row's padding ranks last, and the padding it keeps
    (a row of fewer real tokens than the target) goes first, so the padding stays before the real slots."""
    if real is None:
        return scores.topk(target, dim=-1).indices
    ranked = scores.masked_fill(~real[:, None, :], float("-inf")).topk(target, dim=-1).indices
    is_real = real[:, None, :].expand_as(scores).gather(-1, ranked)
    order = torch.sort(is_real.to(torch.uint8), dim=-1, stable=True).indices
    return ranked.gather(-1, order)


def in_score_order(scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """A prompt's kept slots (ascending) in the order ``torch.topk`` ranks them by ``scores``, where the top of
    the scores is what was kept (kvpress's prefill leaves its cache so, and the cuts while decoding that follow
    break their ties on that order); else as they are."""
    ranked = scores.topk(kept.shape[-1], dim=-1).indices
    return ranked if torch.equal(ranked.sort(dim=-1).values, kept) else kept


def cut_heads(cut, layer: RaggedLayer, context, target: int, consumed: int) -> RaggedLayer:
    """A head-adaptive method's cut while decoding of a layer whose heads already hold their own slots: each head's
    slots are scored as if they alone were the cache, then the method keeps ``target`` x KV heads of them across
    the heads (``HeadAdaptiveMethod.keep``, the slots each head holds marked), and the layer holds only those.
    ``context(row, keys, values)`` is the row's ``LayerContext`` over ``[1, kv_heads, n, d]`` tensors.

    The scorer reads one KV head at a time: its keys and values stand for every KV head of the context (a view, no
    copy), and the head's own row of the scores is taken, so every scorer scores a segment as it scores a uniform
    cache (its window, sinks and pooling at the segment's ends), at ``kv_heads`` times one scoring's work."""
    heads = layer.kv_heads
    keep = []
    for row in range(layer.keys.shape[0]):
        scores, values = [], []
        for head in range(heads):
            start, end = layer.segment(row, head)
            keys_h, values_h = layer.keys[row, start:end], layer.values[row, start:end]
            view = context(row, keys_h.expand(1, heads, *keys_h.shape), values_h.expand(1, heads, *values_h.shape))
            scores.append(cut.prompt_scores(view)[0, head])
            values.append(values_h)
        longest = max(part.shape[0] for part in scores)
        held = torch.stack([torch.arange(longest, device=part.device) < part.shape[0] for part in scores])[None]
        scores = torch.stack([F.pad(part, (0, longest - part.shape[0]), value=float("-inf")) for part in scores])
        padded = None
        if cut.keep_reads_values:  # CriticalAdaKV's norms: the row's values padded to its longest head
            padded = torch.stack([F.pad(part, (0, 0, 0, longest - part.shape[0])) for part in values])[None]
        kept = cut.keep(context(row, None, padded), scores[None], target, held)
        keep.append(kept[0])
    longest = max(part.shape[-1] for part in keep)
    keep = torch.stack([F.pad(part, (0, longest - part.shape[-1]), value=False) for part in keep])
    return layer.kept_slots(keep, consumed)
