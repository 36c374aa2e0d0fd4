"""The method protocol: what every compression method declares, each stage with its default.

A method is a dataclass deriving from ``Method`` in one file of ``snapkv/methods/``, registered with
``snapkv.registry.register``. The hooks (``snapkv.hooks``), the runner and the planner ask the method
at each stage below; no code outside a method's file names that method.

==========================  ===========================================================================
stage                       what the method declares (default)
==========================  ===========================================================================
budget                      ``budget_for(length)``: tokens per KV head (``budget``, or kvpress's
                            ``ratio``); ``recent_window``: the last tokens always kept (``window``)
split across layers         ``layer_budget(i, layers, length)`` (uniform; PyramidKV's pyramid)
split across heads          ``head_adaptive`` and ``select`` returning ``valid`` (uniform: no)
scoring during the prefill  per layer, after its attention, from ``LayerContext`` (window queries, keys,
                            values, hidden states; ``ctx.shared`` computes a score once for every
                            setting asking for it): ``score(ctx)`` for the top-k of ``select``, or
                            ``select(ctx, budget, window)`` itself; ``prompt_scores(ctx)``: every prompt
                            position ranked, for a method wrapping this one (``scores_positions``)
attention weights           ``needs_attention_weights``: ``ctx.attention_weights()`` gives the prefill's
                            own softmax rows ``[b, H, q, L]``, as eager attention computes them (no)
scoring after the prefill   ``scores_after_prefill``: ``replay_key()``, ``scores(replay, full, ids)``
                            once per key for every setting sharing it, then ``cut(scores)`` (none)
storage                     uniform layers, or each head its own slots when ``select`` gives ``valid``
                            (``snapkv.ragged``); ``stored_tokens`` tells the planner (budget)
memory                      ``compression_bytes``: the planner's term for the scoring (required)
padded batches              ``pads_batches`` / ``takes_padded_batch`` (yes, unless a ratio)
naming                      ``method``, ``display_name``, ``tag_parts``, ``label()``, and
                            ``kvpress_entries``: the kvpress registry entries this method is (none)
==========================  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from .errors import InputError, check_choice, check_int
from .select import always_kept, top_positions

POOLINGS = ("maxpool", "avgpool", "none")
GQA_MODES = ("mean", "max", "repeat")

__all__ = ["Method", "InputError", "check_choice", "check_int", "POOLINGS", "GQA_MODES"]


@dataclass
class Method:
    """Base of all method configs.

    ``budget`` is the number of tokens each head keeps after prefill, the always-kept recent
    ``window`` included (as in the official SnapKV ``max_capacity_prompt``). ``ratio`` is the
    alternative (kvpress's ``compression_ratio``): the fraction of a prompt's tokens removed, so a
    prompt of ``n`` tokens keeps ``int(n * (1 - ratio))`` per head, the window included (at least
    ``window + 1``); set exactly one of the two (``budget=None`` with a ratio).
    """

    budget: int | None = 1024
    window: int = 32
    gqa: str = "mean"
    ratio: float | None = None

    method: ClassVar[str] = ""
    display_name: ClassVar[str] = ""
    derived: ClassVar[tuple] = ()   # fields computed from others (left out of labels, tags and configs)
    # how the fields appear in a run's folder tag after ``<method>-<size>``; a field not named here
    # is added as ``<name><value>`` (``tag_template``), so two settings never share a folder
    tag_parts: ClassVar[tuple] = ("w{window}", "{gqa}")
    untagged: ClassVar[tuple] = ()  # fields that cannot change what is kept (still in the fingerprint)
    # whether ``score`` reads the queries of every prompt position (``ctx.queries(length)``): the
    # session then keeps each layer's q_proj output from the module's own call instead of projecting again
    reads_every_query: ClassVar[bool] = False
    # whether ``score``/``select`` reads the pass's attention weights (``ctx.attention_weights()``: every
    # query row's softmax over the layer's keys, ``[b, H, q, L]`` in the model dtype, as eager attention
    # computes them: kvpress's ``attentions``). With eager attention they are the module's own output; with
    # sdpa or flash (which return none) they are computed again from the module's queries and keys, one
    # block of rows at a time, into one ``[b, H, q, L]`` tensor freed once the layer is compressed
    needs_attention_weights: ClassVar[bool] = False
    # whether heads of one layer keep different numbers of positions (``select`` returns ``valid``)
    head_adaptive: ClassVar[bool] = False
    # whether the method scores once the whole prompt is prefilled (KVzip): its layers are kept whole
    # during the prefill and cut after it (``replay_key``, ``scores``, ``cut``)
    scores_after_prefill: ClassVar[bool] = False
    # whether each row of a left-padded batch can be compressed as its prompt alone is (items in flight,
    # ``batch.prefill=padded``): per-layer budgets refuse padding, a replay takes one prompt
    pads_batches: ClassVar[bool] = True
    # whether ``prompt_scores`` ranks prompt positions, so that a wrapper (AdaKV) can take it as its scorer
    scores_positions: ClassVar[bool] = False
    # the kvpress registry entries (``evaluation/evaluate_registry.py``) this method is: entry name ->
    # the fields it sets beyond the method's defaults (the leaderboard preset is generated from them)
    kvpress_entries: ClassVar[dict] = {}
    # the method's card (the docs' method tables are generated from it): its paper, the code it reproduces,
    # what its budget means, and where it knowingly differs
    paper: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    budget_meaning: ClassVar[str] = ""
    deviations: ClassVar[str] = ""

    def takes_padded_batch(self) -> bool:
        """Whether each row of a left-padded batch is compressed as its prompt alone is: not where the
        budget is a share of the prompt (``ratio``: the padded width's share would be taken)."""
        return self.pads_batches and getattr(self, "ratio", None) is None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_int("window", self.window, 1)
        self.check_budget_or_ratio()
        if self.ratio is None and self.budget <= self.window:
            raise InputError(f"budget={self.budget} must be larger than window={self.window}")
        check_choice("gqa", self.gqa, GQA_MODES)

    def check_budget_or_ratio(self) -> None:
        if self.ratio is None:
            check_int("budget", self.budget, 2)
            return
        if self.budget is not None:
            raise InputError(f"budget={self.budget} and ratio={self.ratio}: set exactly one of the two "
                             "(budget=null with a ratio)")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise InputError(f"ratio={self.ratio!r} must be a number in [0, 1): the fraction of the prompt removed")
        self.ratio = float(self.ratio)

    def budget_for(self, length: int) -> int:
        """Tokens per head a prompt of ``length`` tokens keeps: ``budget``, or from ``ratio`` as kvpress
        computes ``n_kept`` (never fewer than ``window + 1``, so something besides the window is chosen)."""
        if self.ratio is None:
            return self.budget
        return max(int(length * (1 - self.ratio)), self.window + 1)

    @property
    def compresses(self) -> bool:
        return True

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        """Tokens kept per head at ``layer_idx`` for a prompt of ``length`` tokens (uniform unless a
        method says otherwise; a layer whose budget is at least ``length`` is left untouched)."""
        return self.budget_for(length)

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        """The most recent prompt tokens every head keeps unconditionally."""
        return self.window

    def stored_tokens(self, layer_idx: int, num_layers: int, length: int, heads: int) -> int:
        """Slots per head a layer stores (for the memory planner): its budget. A head-adaptive layer
        stores each head's own slots packed (``snapkv.ragged``), ``heads x`` the average per head."""
        return min(length, self.layer_budget(layer_idx, num_layers, length))

    def select(self, ctx, budget: int, window: int):
        """The prompt positions each head keeps, ``(kept, valid)``: ``kept`` ``[batch, heads, n]``
        ascending, ``valid`` None where every head keeps ``n`` (uniform), else ``[batch, heads, n]``
        marking each head's real slots (head-adaptive; its other slots hold positions it did not keep and
        are never attended to). Uniform: the top ``budget - window`` earlier positions by ``score``
        (ranked per row on its real tokens) and the last ``window``."""
        length = ctx.keys.shape[-2]
        kept = top_positions(self.score(ctx), budget - window, ctx.pad_mask)
        recent = torch.arange(length - window, length, device=kept.device)
        return torch.cat([kept, recent.expand(*kept.shape[:2], window)], dim=-1), None

    def prompt_scores(self, ctx) -> torch.Tensor:
        """``[b, kv_heads, L]``: every prompt position ranked, the recent window above every other position
        (what a wrapper such as AdaKV allocates from; ``scores_positions`` says a method gives it)."""
        length = ctx.keys.shape[-2]
        return always_kept(self.score(ctx), last=self.recent_window(ctx.layer_idx, ctx.num_layers, length))

    # scoring after the prefill (``scores_after_prefill``; KVzip's context replay)
    def replay_key(self) -> tuple:
        """Settings whose ``replay_key`` is equal share one ``scores`` call per prefill."""
        return (self.method,)

    def scores(self, replay, full: list, prompt_ids: torch.Tensor) -> torch.Tensor:
        """After the prefill: scores of every (layer, row, KV head, position) from ``replay``
        (``snapkv.hooks.Replay``: the model, its decoder layers and stack, its tokenizer), ``full`` (per
        layer, the full keys and values) and the prompt's ids."""
        raise NotImplementedError(f"{self.method}: scores_after_prefill without scores()")

    def cut(self, scores: torch.Tensor) -> list:
        """Per layer ``(kept, valid)`` from ``scores``, as ``select`` returns them."""
        raise NotImplementedError(f"{self.method}: scores_after_prefill without cut()")

    def score(self, ctx) -> "torch.Tensor":  # noqa: F821
        """Importance of the earlier positions ``[0, L - window)``: ``[batch, heads, L - window]``.

        Padded positions need no special score: ``top_positions`` ranks each row on its real tokens."""
        raise NotImplementedError

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """For the memory planner (``snapkv.memory``): the bytes this method's scoring allocates at its
        largest while one layer of ``length`` tokens is compressed, beside that layer's full K and V
        (``shape``: the model's ``memory.Shape``; ``nbytes``: bytes per element of the model dtype).
        The planner adds what every method shares (the copy ``gqa="repeat"`` makes). Every method
        that compresses gives its own: there is no default, since a guessed term is a wrong plan."""
        raise InputError(f"compressor.method={self.method!r}: the memory planner has no estimate of this "
                         "method's compression (its config class defines no compression_bytes)")

    def label(self) -> str:
        """A short run label, ``SnapKV 1024``, with the fields that differ from the method's defaults
        (``SnapKV 1024 (window 16, kernel 5)``)."""
        name = self.display_name or self.method
        if not self.compresses:
            return name
        changed = [f"{f.name} {getattr(self, f.name)}" for f in fields(self)
                   if f.name not in ("budget", "ratio", *self.derived) and getattr(self, f.name) != f.default]
        size = f"{self.budget}" if self.ratio is None else f"ratio {self.ratio:g}"
        return f"{name} {size}" + (f" ({', '.join(changed)})" if changed else "")

    @classmethod
    def tag_template(cls) -> tuple:
        """Every field's part of the run tag, ``tag_parts`` first (``("w{window}", "k{kernel}", ...)``)."""
        named = "".join(cls.tag_parts)
        rest = tuple(f"{f.name}{{{f.name}}}" for f in fields(cls)
                     if f.name not in ("budget", "ratio", *cls.derived, *cls.untagged) and f"{{{f.name}}}" not in named)
        return tuple(cls.tag_parts) + rest

    def describe(self) -> dict:
        out = {"method": self.method}
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        return out
