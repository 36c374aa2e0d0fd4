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
ranking scores              ``ranking_scores(ctx)``: the per-head scores ``select`` ranks, and ``ranking_bounds``:
                            how far another machine's rounding could move them, recorded on request for telling
                            a tie at the cut from a real difference (``prompt_scores`` where ``scores_positions``,
                            else None; each score plus or minus the tolerance)
scoring after the prefill   ``scores_after_prefill``: ``replay_key()``, ``scores(replay, full, ids)``
                            once per key for every setting sharing it, then ``cut(scores)`` (none)
scoring while decoding      ``decodes`` (set by ``decode_target``/``decode_ratio``): every ``decode_interval``
                            decoded tokens each layer is cut back by ``select`` on a ``LayerContext`` of the
                            cache's slots and the last decoded tokens' hidden states (kvpress's
                            ``DecodingPress``); ``scores_while_decoding`` says a method can (yes, but a
                            replay or the pass's attention weights); a head-adaptive one cuts a layer whose
                            heads hold their own slots by ``prompt_scores`` per head and ``keep(..., held)``
storage                     uniform layers, or each head its own slots when ``select`` gives ``valid``
                            (``snapkv.ragged``); ``stored_tokens`` tells the planner (budget)
fewer key channels          ``stores_key_channels``: ``key_channels(ctx)``, the channels each KV head's prompt
                            keys keep, stored alone (``snapkv.channels``) even where no token is cut;
                            ``stored_key_channels`` tells the planner (every channel)
memory                      ``compression_bytes``: the planner's term for the scoring (required)
padded batches              ``pads_batches`` / ``takes_padded_batch`` (yes, unless a ratio)
once per model              ``prepare(replay)``: when ``snapkv.compress`` starts, before any prefill, with the
                            model (``snapkv.hooks.Replay``): scores fixed per model, e.g. DuoAttention's
                            heads (nothing); ``needs_local_data``: a setting needs a local file named in a
                            field, so one built from its defaults cannot run (no)
the leaderboard's x         ``board_size``: the field kvpress's leaderboard reads as a setting's compression ratio
                            (``ratio``; DuoAttention's ``head_ratio``, as kvpress's ``evaluate.py`` sets it)
the question's length       ``needs_question_length``: ``ctx.question_tokens``, how many of the prompt's last tokens
                            are its question (``compress(..., question_tokens=)`` or ``session.question_tokens``;
                            missing: one line naming what to pass); one per prompt, no padded batch (no)
re-rotated keys             ``rerotates_keys``: the kept keys are moved to positions ``0..n-1`` (RoPE by
                            ``new - old``, kvpress's ``KeyRerotationPress``); every layer keeps the same ``n`` and
                            the cache continues as a plain one of ``n`` tokens, the next token at ``n`` (no)
naming                      ``method``, ``display_name``, ``tag_parts``, ``label()``, and
                            ``kvpress_entries``: the kvpress registry entries this method is (none)
==========================  ===========================================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from .errors import InputError, check_choice, check_int
from .select import always_kept, top_positions

POOLINGS = ("maxpool", "avgpool", "none")
# the fields of compression while decoding: in a run's tag only when set (``decoding_tag``)
DECODING_FIELDS = ("decode_target", "decode_ratio", "decode_interval", "decode_buffer", "decode_query_positions")
# kvpress's DecodingPress defaults; and the positions its buffered queries are rotated at: every one at the current
# token's ("current", as kvpress's scorers read the pass's position embeddings), or each at its own ("own")
DECODING_DEFAULTS = {"decode_interval": 512, "decode_buffer": 256, "decode_query_positions": "current"}
QUERY_POSITIONS = ("current", "own")
GQA_MODES = ("mean", "max", "repeat")
# how far another machine's float32 rounding is taken to move a score, relative (``Method.ranking_bounds``)
TIE_TOLERANCE = 1e-5

__all__ = ["Method", "InputError", "check_choice", "check_int", "POOLINGS", "GQA_MODES", "DECODING_FIELDS",
           "decoding_tag"]


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
    # compression while the model writes (kvpress's DecodingPress; docs/decoding.md): every
    # ``decode_interval`` decoded tokens each layer is cut back to ``decode_target`` tokens per head, or to
    # ``1 - decode_ratio`` of every token seen so far (kvpress's CompressionRatioDecodingPress), scored from
    # the cache and the hidden states of the last ``decode_buffer`` decoded tokens (and the current one)
    decode_target: int | None = None
    decode_ratio: float | None = None
    decode_interval: int | None = None  # None: kvpress's 512 once decoding cuts are set
    decode_buffer: int | None = None    # None: kvpress's 256 once decoding cuts are set
    decode_query_positions: str | None = None  # None: kvpress's "current" once decoding cuts are set

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
    # whether ``select`` can cut a cache while decoding (``decode_target``): the hooks give it the cache's slots
    # as ``ctx.keys``/``ctx.values`` and the last decoded tokens' hidden states; a method needing a replay or the
    # pass's attention weights cannot (``decodes`` refuses it); a head-adaptive one (``HeadAdaptiveMethod``) cuts
    # a ragged layer head by head (``snapkv.decoding_cuts.cut_heads``)
    scores_while_decoding: ClassVar[bool] = True
    # whether ``prompt_scores`` ranks prompt positions, so that a wrapper (AdaKV) can take it as its scorer
    scores_positions: ClassVar[bool] = False
    # whether a setting needs a local file named in one of its fields (DuoAttention's head patterns or texts) before
    # it can run: one built from its defaults cannot (a missing path is one line), so the generic tests skip it
    needs_local_data: ClassVar[bool] = False
    # the field kvpress's leaderboard reads as a setting's compression ratio (its x axis; ``eval.report.leaderboard``)
    board_size: ClassVar[str] = "ratio"
    # whether ``select`` reads the question's length (``ctx.question_tokens``: how many of the prompt's last tokens
    # are its question, FINCH's observation window). The session is told it per prefill (``snapkv.compress(...,
    # question_tokens=N)`` or ``session.question_tokens = N`` before the prefill); a prefill without it is refused
    # with one line, and so is a padded batch (one question length per prompt)
    needs_question_length: ClassVar[bool] = False
    # the kvpress registry entries (``evaluation/evaluate_registry.py``) this method is: entry name ->
    # the fields it sets beyond the method's defaults (the leaderboard preset is generated from them)
    kvpress_entries: ClassVar[dict] = {}
    # the method's card (the docs' method tables are generated from it): its paper, the code it reproduces,
    # what its budget means, and where it knowingly differs
    paper: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    budget_meaning: ClassVar[str] = ""
    deviations: ClassVar[str] = ""

    @property
    def rerotates_keys(self) -> bool:
        """Whether the kept keys are re-rotated after the cut (kvpress's ``KeyRerotationPress``): each kept key is
        moved from its prompt position to its index ``0..n-1`` among the kept ones (RoPE by ``new - old``, from the
        model's rotary embedding), so the cache is then a plain contiguous cache of ``n`` tokens: the next token sits
        at position ``n``, not at the prompt's length, whatever positions the caller passes (``generate`` counts from
        the prompt's length). Every layer must keep the same ``n``, ascending (a uniform ``select``); ``kept_positions``
        still lists the prompt positions kept. No by default."""
        return False

    def takes_padded_batch(self) -> bool:
        """Whether each row of a left-padded batch is compressed as its prompt alone is: not where the
        budget is a share of the prompt (``ratio``: the padded width's share would be taken)."""
        return self.pads_batches and getattr(self, "ratio", None) is None

    def __post_init__(self) -> None:
        self.validate()
        self.check_decoding()

    # compression while decoding (``decode_*`` fields; DECODING_FIELDS stay out of the tag template and the
    # label unless set, so a setting without them keeps the name and folder it had before they existed)
    @property
    def decodes(self) -> bool:
        """Whether this setting cuts the cache while the model writes."""
        return self.decode_target is not None or self.decode_ratio is not None

    def check_decoding(self) -> None:
        if not self.decodes:
            return
        if self.decode_target is not None and self.decode_ratio is not None:
            raise InputError(f"decode_target={self.decode_target} and decode_ratio={self.decode_ratio}: set at most "
                             "one of the two")
        if self.decode_target is not None:
            check_int("decode_target", self.decode_target, 1)
        elif isinstance(self.decode_ratio, bool) or not isinstance(self.decode_ratio, (int, float)) \
                or not 0 <= self.decode_ratio < 1:
            raise InputError(f"decode_ratio={self.decode_ratio!r} must be a number in [0, 1): the share of every "
                             "token seen so far that is removed")
        for name, default in DECODING_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        check_int("decode_interval", self.decode_interval, 1)
        check_int("decode_buffer", self.decode_buffer, 0)
        check_choice("decode_query_positions", self.decode_query_positions, QUERY_POSITIONS)
        reason = self.cannot_decode()
        if reason:
            option = "decode_target" if self.decode_target is not None else "decode_ratio"
            raise InputError(f"{option}: {self.method} cannot cut the cache while decoding ({reason}); methods that "
                             "can: " + ", ".join(decoding_methods()))
        if self.decode_target is not None:
            try:
                self.for_decoding(self.decode_target)
            except InputError as error:
                raise InputError(f"decode_target={self.decode_target}: as {self.method}'s budget while decoding, "
                                 f"{error}") from None

    def cannot_decode(self) -> str:
        """Why this method cannot score while decoding ('' where it can)."""
        if not self.compresses:
            return "it keeps every token"
        if self.scores_after_prefill:
            return "its scores need a replay of the prompt"
        if self.needs_attention_weights:
            return "its scores need every query's attention weights"
        if self.reads_every_query:
            return "its scores need the query of every prompt position"
        if self.gqa == "repeat":
            return "gqa=repeat stores a cache per query head; use mean or max"
        if not self.scores_while_decoding:
            return "its scores are defined on a prompt only"
        return ""

    def decoding_target(self, tokens_seen: int) -> int:
        """Tokens per head a cut while decoding keeps, ``tokens_seen`` tokens into the sequence (prompt and
        generation): ``decode_target``, or kvpress's ``max(1, int(seen * (1 - decode_ratio)))``."""
        if self.decode_target is not None:
            return self.decode_target
        return max(1, int(tokens_seen * (1 - self.decode_ratio)))

    def for_decoding(self, target: int) -> "Method":
        """This method with ``target`` as its budget: what ``select`` and ``recent_window`` read during a cut
        while decoding (StreamingLLM's recent tokens, SnapKV's window all follow from the budget)."""
        return dataclasses.replace(self, budget=target, ratio=None, decode_target=None, decode_ratio=None)

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

    # storage with fewer key channels (ThinK): the hooks store a layer of such a method even where no token is cut
    stores_key_channels: ClassVar[bool] = False

    def key_channels(self, ctx) -> "torch.Tensor | None":
        """The key channels each KV head's prompt keys keep, ``[batch, kv_heads, d_kept]`` ascending, from
        ``ctx`` after the layer's prefill attention (``stores_key_channels``): the layer then stores only those
        channels of its prompt's keys (``snapkv.channels.KeyChannelLayer``; attention over them equals attention
        over keys whose other channels are zero). None: every channel (the default)."""
        return None

    def stored_key_channels(self, head_dim: int) -> int:
        """Channels a prompt key keeps per KV head, for the memory planner (every one by default)."""
        return head_dim

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

    def ranking_scores(self, ctx) -> "torch.Tensor | None":
        """``[b, heads, L]``: the scores whose ranking decides what ``select`` keeps (per head; over all the layer's
        heads at once for a ``head_adaptive`` method), as this code computes them (``snapkv.compress(...,
        record_scores=True)`` records them per layer with ``ranking_bounds``: ``snapkv.ranking_scores``). None where
        the cut is no such ranking (chunked, replayed or two-stage cuts). By default ``prompt_scores`` for a uniform
        method that ``scores_positions``."""
        return self.prompt_scores(ctx) if self.scores_positions and not self.head_adaptive else None

    def ranking_bounds(self, ctx, scores: torch.Tensor, tolerance: float) -> tuple:
        """``(low, high)``, each like ``scores``: the least and the most each position's ranked score could be had the
        values it is computed from been rounded otherwise, by ``tolerance`` relative (another machine's float32
        kernels). A cut whose score lies within a position's bounds may fall either way there: a parity check against
        a reference run elsewhere accepts such a difference and no other. By default ``scores`` less and plus
        ``tolerance`` of their magnitude; a method ranking ranks overrides it."""
        spread = tolerance * scores.abs().clamp(min=torch.finfo(scores.dtype).tiny)
        return scores - spread, scores + spread

    def prepare(self, replay) -> None:
        """Once per ``snapkv.compress`` session, before any prefill: what the method fixes per model from
        ``replay`` (``snapkv.hooks.Replay``: the model, its decoder layers and stack, its tokenizer), as kvpress's
        ``post_init_from_model`` (DuoAttention's streaming heads). Its time is in no prompt's compression.
        Nothing by default."""
        return None

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

    def prefill_rows(self, length: int, question_tokens: int | None) -> int | None:
        """How many of a prefill's last positions ``select`` reads the layer input of (``ctx.hidden_states``, its
        queries and position embeddings), for a prompt of ``length`` tokens; None: every position. A chunked
        prefill (``snapkv.prefill``) keeps only the last chunk's rows, at least this many; None runs each layer in
        one chunk, as long as the prompt. Default None: a method reading fewer says so."""
        return None

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
                   if f.name not in ("budget", "ratio", *self.derived, *DECODING_FIELDS)
                   and getattr(self, f.name) != f.default]
        size = f"{self.budget}" if self.ratio is None else f"ratio {self.ratio:g}"
        if self.decodes:
            kept = self.decode_target if self.decode_target is not None else f"ratio {self.decode_ratio:g}"
            changed.append(f"decoding {kept} every {self.decode_interval}")
            if self.decode_query_positions != DECODING_DEFAULTS["decode_query_positions"]:
                changed.append(f"queries at their {self.decode_query_positions} positions")
        return f"{name} {size}" + (f" ({', '.join(changed)})" if changed else "")

    @classmethod
    def tag_template(cls) -> tuple:
        """Every field's part of the run tag, ``tag_parts`` first (``("w{window}", "k{kernel}", ...)``)."""
        named = "".join(cls.tag_parts)
        rest = tuple(f"{f.name}{{{f.name}}}" for f in fields(cls)
                     if f.name not in ("budget", "ratio", *cls.derived, *cls.untagged, *DECODING_FIELDS)
                     and f"{{{f.name}}}" not in named)
        return tuple(cls.tag_parts) + rest

    def describe(self) -> dict:
        out = {"method": self.method}
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        return out


def decoding_tag(target, ratio, interval, buffer, query_positions=None) -> str:
    """The run tag's part for compression while decoding: ``""`` when off, else ``-dt512-di128-db256`` (target)
    or ``-dr0.5-di128-db256`` (ratio), and ``-qpown`` for queries at their own positions."""
    if target is None and ratio is None:
        return ""
    interval = DECODING_DEFAULTS["decode_interval"] if interval is None else interval
    buffer = DECODING_DEFAULTS["decode_buffer"] if buffer is None else buffer
    size = f"dt{target}" if target is not None else f"dr{ratio:g}" if isinstance(ratio, (int, float)) else f"dr{ratio}"
    own = "" if query_positions in (None, DECODING_DEFAULTS["decode_query_positions"]) else f"-qp{query_positions}"
    return f"-{size}-di{interval}-db{buffer}{own}"


def decoding_methods() -> list[str]:
    """The registered methods that can cut a cache while decoding."""
    from .registry import METHODS  # the registry imports no method; at call time it holds them all
    return sorted(name for name, cls in METHODS.items() if not cls().cannot_decode())
