"""What a compressed cache needs to be decoded correctly, and how that changes pass by pass.

The state lives on the cache object, so several caches can be alive in one session (one per setting
of a shared prefill, or a merged batch) and each keeps its own positions and mask.

==================  =============  ==========  ==========================================================
state               ``in_prefill``  compressed  entered by
==================  =============  ==========  ==========================================================
prefilling          True           False       ``for_prefill``: a prompt's first pass starts
compressing         True           True        ``mark_compressed``: the first layer longer than its budget
                                               was cut
plain               False          False       ``end_pass`` after a prefill that cut nothing (full KV, a
                                               prompt within the budget); later passes only ``advance``
decoding            False          True        ``end_pass`` after a compressing prefill; each later pass
                                               ``begin_pass`` gives explicit positions and the kept mask
later turn          True           True        ``begin_pass`` of several tokens with
                                               ``compress_later_turns``: that turn's prompt is cut too
merged              False          True        ``snapkv.merge_caches``: ``layer_masks`` mark each row's
                                               real slots per layer
head-adaptive       any            True        a head-adaptive method cut a layer: it is a
                                               ``snapkv.ragged.RaggedLayer`` (``head_adaptive``)
renumbered          False          True        ``end_pass`` after a prefill whose cut re-rotated the kept keys
                                               (``Method.rerotates_keys``): a contiguous cache of ``n``
                                               tokens; ``consumed`` and ``next_positions`` restart at ``n``
                                               and each later pass takes the cache's own positions
==================  =============  ==========  ==========================================================
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .errors import InputError
from .method import Method
from .timing import Ledger
from .transformers_workarounds import report_consumed, rolls_back


def host_copy(scores: torch.Tensor) -> torch.Tensor:
    """A float32 copy on the CPU, kept apart from the cache."""
    return scores.detach().float().cpu().clone()


class RankedScores(NamedTuple):
    """One layer's ranked scores ``[batch row, head, prompt position]`` and the least and most each could be under
    another machine's rounding (``Method.ranking_scores``, ``Method.ranking_bounds``)."""
    scores: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    across_heads: bool = False  # one cut over all the layer's heads at once (head-adaptive), else one per head
    # a cut while decoding ranks the layer's slots: the position each slot held, and which slots the cut kept
    positions: torch.Tensor | None = None
    kept: torch.Tensor | None = None


@dataclass
class CacheState:
    pad_mask: torch.Tensor | None       # padding of the sequence being compressed now
    next_positions: torch.Tensor        # per row, the absolute position of the next token
    consumed: int                       # tokens the cache has seen (what get_seq_length reports once cut)
    in_prefill: bool = True             # this pass's layers are compressed after their attention
    cache_lengths: dict = field(default_factory=dict)   # layer -> tokens per head kept
    kept_mask: torch.Tensor | None = None  # [rows, kept]: which kept slots are real (padded batches)
    compressed: bool = False
    query_len: int = 0                  # tokens of the current pass
    pass_kept: torch.Tensor | None = None  # padding kept by the first layer compressed in this pass
    cfg: Method | None = None           # the setting this cache follows
    siblings: list = field(default_factory=list)  # (cache, state) of the other settings of a shared prefill
    layer_masks: list | None = None     # caches merged into one batch: per layer, [rows, length] real slots
    layer_segments: list | None = None  # ... and per layer, (first row, end row, first real slot) of each member
    head_adaptive: bool = False         # a layer holds each head's own slots (snapkv.ragged.RaggedLayer)
    prompt_slots: dict = field(default_factory=dict)  # cut layers: layer -> kept positions, see record_slots
    prompt_length: int = 0              # the (padded) prompt length of the latest compressing pass
    row_pads: torch.Tensor | None = None  # per row, the padding before its prompt (left-padded batches)
    prompt_ids: torch.Tensor | None = None  # the prompt, for a method scoring after the prefill (KVzip)
    compression: Ledger = field(default_factory=Ledger)  # this setting's compression time (snapkv.timing)
    decoding: dict = field(default_factory=dict)  # layer -> its DecodingBuffer (compression while decoding)
    decoding_seconds: Ledger = field(default_factory=Ledger)  # the time its cuts while decoding took
    decoding_cuts: int = 0              # cuts while decoding so far (of every layer)
    cut_mask: torch.Tensor | None = None  # this pass's cuts while decoding: which kept slots are real
    cut_in_pass: bool = False
    question_tokens: int | None = None  # how many of the prompt's last tokens are its question (needs_question_length)
    rerotated_layers: set = field(default_factory=set)  # layers this prefill cut and re-rotated (rerotates_keys)
    renumbered: bool = False            # the kept keys sit at 0..n-1: positions are the cache's own (see the table)
    ranking_scores: dict = field(default_factory=dict)  # layer -> what its cut ranked (record_scores), or None
    decoding_rankings: dict = field(default_factory=dict)  # layer -> what each of its cuts while decoding ranked
    crop_floor: int = 0                 # tokens consumed at the last compression: a crop may not go below (crop)
    speculating: bool = False           # passes verify drafts (``speculating``): cuts while decoding wait for crop
    pending_cuts: object = None         # a verification pass buffered past a cut's count: run them once cropped

    @classmethod
    def for_prefill(cls, cfg: Method, pad_mask, next_positions: torch.Tensor, q_len: int) -> "CacheState":
        pads = None if pad_mask is None else (~pad_mask).sum(dim=1).cpu()
        return cls(pad_mask=pad_mask, next_positions=next_positions.clone(), consumed=q_len, cfg=cfg,
                   prompt_length=q_len, row_pads=pads)

    def advance(self, q_len: int) -> None:
        """A pass of ``q_len`` tokens on a cache nothing was cut from: a plain cache (a padded batch's
        padding mask grows with it, every new token real)."""
        self.consumed += q_len
        self.next_positions = self.next_positions + q_len
        if self.pad_mask is not None and not self.compressed:
            ones = torch.ones(self.pad_mask.shape[0], q_len, dtype=torch.bool, device=self.pad_mask.device)
            self.pad_mask = torch.cat([self.pad_mask, ones], dim=1)

    def begin_pass(self, q_len: int, compress_later_turns: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pass of ``q_len`` tokens after compression: the position ids the tokens take and the 2-D
        attention mask to give the model (None: causal masking is right for every layer)."""
        steps = torch.arange(q_len, device=self.next_positions.device)
        positions = self.next_positions[:, None] + steps[None, :]
        self.advance(q_len)
        self.query_len = q_len
        self.in_prefill = compress_later_turns and q_len > 1
        self.pass_kept = None
        if self.kept_mask is not None:
            ones = torch.ones(self.kept_mask.shape[0], q_len, dtype=torch.bool, device=self.kept_mask.device)
            self.kept_mask = torch.cat([self.kept_mask, ones], dim=1)
        self.pad_mask = self.kept_mask
        return positions, self.kept_mask

    def end_pass(self) -> None:
        """The decoder has run every layer: this prefill's caches decode on their own from now on."""
        for one in (self, *(sibling for _, sibling in self.siblings)):
            if one.in_prefill and one.rerotated_layers:
                one.renumber()
            if one.in_prefill and one.compressed:
                one.crop_floor = one.consumed
            one.in_prefill = False
        self.siblings = []

    def renumber(self) -> None:
        """After a prefill whose cut re-rotated the kept keys to ``0..n-1`` (``Method.rerotates_keys``): the cache
        is a contiguous one of ``n`` tokens, so the next token sits at ``n`` (kvpress's pipeline continues at
        ``cache.get_seq_length()``). Every layer must have been cut to the same ``n``."""
        kept = set(self.cache_lengths.values())
        if self.rerotated_layers != set(self.cache_lengths) or len(kept) != 1:
            raise InputError(f"{self.cfg.method}: re-rotated keys need every layer cut to the same number of tokens "
                             f"(layers kept {sorted(kept)})")
        n = kept.pop()
        self.consumed = n
        self.next_positions = torch.full_like(self.next_positions, n)
        self.rerotated_layers = set()
        self.renumbered = True

    def record_layer(self, layer_idx: int, kept_tokens: int) -> None:
        self.cache_lengths[layer_idx] = kept_tokens

    def record_kept(self, kept: torch.Tensor) -> None:
        """Remember which kept slots are padding (left-padded rows shorter than the budget)."""
        if self.pad_mask is None:
            return
        mask = self.pad_mask.gather(1, kept[:, 0])
        if self.pass_kept is not None and not torch.equal(self.pass_kept, mask):
            raise InputError(f"{self.cfg.method}: layers kept different padding; run batch size 1")
        self.pass_kept = self.kept_mask = mask

    def slot_positions(self, layer_idx: int, rows: int, heads: int, slots: int, device) -> torch.Tensor:
        """``[rows, heads, slots]``: the position (in the padded sequence) each slot of a layer holds now,
        before this pass cuts it: the slots kept by the last cut, then the tokens appended since."""
        held = self.prompt_slots.get(layer_idx)
        if held is None:
            return torch.arange(slots, dtype=torch.int32, device=device).expand(rows, heads, slots)
        appended = torch.arange(self.consumed - (slots - held.shape[-1]), self.consumed, dtype=torch.int32,
                                device=device)
        return torch.cat([held.expand(rows, heads, -1), appended.expand(rows, heads, -1)], dim=-1)

    def record_ranking_scores(self, layer_idx: int, scores: torch.Tensor | None, bounds: tuple | None,
                              across_heads: bool = False) -> None:
        """What the prefill's cut of ``layer_idx`` ranked (``Method.ranking_scores``) and its ``ranking_bounds``, as
        float32 copies on the CPU; None where the cut ranks no per-head scores."""
        if scores is None:
            self.ranking_scores[layer_idx] = None
            return
        self.ranking_scores[layer_idx] = RankedScores(*map(host_copy, (scores, *bounds)), across_heads)

    def record_slots(self, layer_idx: int, kept: torch.Tensor, slots: int) -> None:
        """Remember which positions a cut layer keeps (``snapkv.kept_positions``), as int32 beside the
        cache (4 bytes a kept position and head: no copy to the host, no sync during the prefill);
        ``kept`` indexes the layer's ``slots`` slots."""
        rows, heads = kept.shape[:2]
        positions = self.slot_positions(layer_idx, rows, heads, slots, kept.device)
        self.prompt_slots[layer_idx] = positions.gather(-1, kept.to(torch.int64))
        self.prompt_length = self.consumed

    def record_decoding_ranking(self, layer_idx: int, scores: torch.Tensor, bounds: tuple, kept: torch.Tensor) -> None:
        """A cut while decoding of ``layer_idx`` (before ``record_decoding_cut``) ranked ``scores`` over its slots and
        kept the slots ``kept``: kept with the position each slot held (``record_scores``)."""
        rows, heads, slots = scores.shape
        positions = self.slot_positions(layer_idx, rows, heads, slots, scores.device)
        mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, kept, True)
        self.decoding_rankings.setdefault(layer_idx, []).append(RankedScores(
            *map(host_copy, (scores, *bounds)), False, positions.cpu().clone(), mask.cpu()))

    def record_decoding_cut(self, layer_idx: int, kept: torch.Tensor, slots: int, target: int) -> None:
        """A layer of ``slots`` slots was cut while decoding to ``kept``: its positions, its length, and the
        padding it keeps (applied once the pass's every layer has been cut, ``finish_decoding_cuts``)."""
        self.record_slots(layer_idx, kept, slots)
        self.record_layer(layer_idx, kept.shape[-1])
        self.decoding_cuts += 1
        self.cut_in_pass = True
        if self.pad_mask is not None and self.pad_mask.shape[-1] == slots:
            mask = self.pad_mask.gather(1, kept[:, 0])
            if self.cut_mask is not None and not torch.equal(self.cut_mask, mask):
                raise InputError(f"{self.cfg.method}: layers kept different padding while decoding; run batch size 1")
            self.cut_mask = mask

    def record_headwise_cut(self, layer_idx: int, target: int) -> None:
        """A layer was cut while decoding to each head's own slots (a ``RaggedLayer`` holding its kept positions,
        ``target`` a head on average, and no padding)."""
        self.prompt_slots.pop(layer_idx, None)
        self.record_layer(layer_idx, target)
        self.decoding_cuts += 1
        self.cut_in_pass = self.head_adaptive = True
        self.prompt_length = self.consumed

    def finish_decoding_cuts(self, cache) -> None:
        """After a pass whose layers were cut while decoding: the cache decodes as a compressed one from now on
        (positions given explicitly, its kept padding masked)."""
        if not self.cut_in_pass:
            return
        self.cut_in_pass = False
        mask, self.cut_mask = self.cut_mask, None
        self.kept_mask = None if mask is None or bool(mask.all()) else mask
        self.pad_mask = self.kept_mask
        self.crop_floor = self.consumed
        self.mark_compressed(cache)

    def crop(self, cache, tokens: int) -> None:
        """``cache.crop(-tokens)`` as transformers calls it after each verification pass of assisted and prompt-lookup
        decoding (``tokens``: its rejected drafts, maybe none): the last ``tokens`` slots of every layer go, and with
        them the positions, the consumed count, the kept padding and the buffered tokens of cuts while decoding they
        added; then the cuts that pass's accepted tokens make due run. A sliding-window layer (recording its past)
        is held back to its window. Only tokens appended since the last compression (the prefill's, a merge, a cut
        while decoding) can go (one line otherwise)."""
        if tokens > 0:
            raise InputError(f"crop({tokens}): give the tokens to remove as a negative number, as transformers does")
        tokens = -tokens
        if self.consumed - tokens < self.crop_floor:
            raise InputError(f"crop(-{tokens}): the cache was compressed after {self.crop_floor} tokens and has "
                             f"consumed {self.consumed}; only the {self.consumed - self.crop_floor} appended since "
                             "can be removed")
        for layer in cache.layers:
            layer.crop(-tokens)
        if tokens:
            self.consumed -= tokens
            self.next_positions = self.next_positions - tokens
            if self.kept_mask is not None:
                self.kept_mask = self.kept_mask[:, :-tokens]
                self.pad_mask = self.kept_mask
            elif self.pad_mask is not None and not self.compressed:
                self.pad_mask = self.pad_mask[:, :-tokens]
            for buffer in self.decoding.values():
                buffer.drop_last(tokens)
        pending, self.pending_cuts = self.pending_cuts, None
        if pending is not None:
            pending(cache)

    def mark_compressed(self, cache) -> None:
        if not self.compressed:
            self.compressed = True
            report_consumed(cache, self)

    def lengths(self) -> list[int]:
        return [self.cache_lengths[i] for i in sorted(self.cache_lengths)]


_STATE = "_snapkv_state"


def state_of(cache) -> CacheState | None:
    """The compression state a cache carries (None: a cache no compression session has filled)."""
    return getattr(cache, _STATE, None)


def tokens_before_cut(cache) -> int | None:
    """How many tokens a pass on ``cache`` may carry before a cut while decoding falls inside it (its setting's
    ``decode_interval`` less the tokens every layer's buffer has counted since the last cut, none yet: a whole
    interval); None where the setting does not cut while decoding. A speculative pass drafts at most one less (the last
    accepted token comes first)."""
    state = state_of(cache)
    if state is None or state.cfg is None or not (state.cfg.compresses and state.cfg.decodes):
        return None
    return state.cfg.decode_interval - max((buffer.steps for buffer in state.decoding.values()), default=0)


@contextmanager
def speculating(cache):
    """While it lasts, the passes on ``cache`` verify drafts (speculative decoding): each is followed by
    ``cache.crop(-rejected)``, so a setting cutting while decoding buffers a verification pass's tokens and cuts
    once the accepted ones are known, and sliding-window layers record their past so that a crop can restore it.
    At the end, the sliding layers are held back to their window again."""
    state = state_of(cache)
    sliding = [layer for layer in cache.layers if hasattr(layer, "record_past")]
    if state is not None:
        state.speculating = True
    for layer in sliding:
        layer.activate_past_recording()
    try:
        yield
    finally:
        if state is not None:
            state.speculating = False
        for layer in sliding:
            if layer.is_initialized:
                layer.crop(0)
            layer.record_past = False


def set_state(cache, state: CacheState) -> None:
    setattr(cache, _STATE, state)
    rolls_back(cache, lambda held, tokens: state_of(held).crop(held, tokens))
