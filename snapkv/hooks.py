"""The transformers integration: compress each layer's cache right after its prefill attention.

Forward hooks on every attention module replace that layer's freshly written full-length KV by
the kept positions before the next layer runs, so the full KV of all layers never coexists. The
prefill's own attention still saw the full KV (as in the official code); only what is stored is
compressed. A pre-hook on the decoder keeps decoding consistent with the shorter cache: absolute
position ids (the first generated token sits at the prompt length) and an attention mask of the
compressed length (padded positions kept only where a row is shorter than the budget).

Several settings, one prefill: given a list of configs, a prefill leaves one cache per setting
(the cache passed to the model holds the first; ``session.caches`` lists them all). Every method
compresses after the layer's attention, so the prefill's computation is the same for all of them;
after each layer's attention the full KV of that layer is compressed once per setting and then
dropped, so memory holds the kept caches plus one layer's full KV. Scores that several settings
compute alike (SnapKV's window attention for every budget and kernel, H2O's accumulated attention
for every budget) are computed once per layer (``LayerContext.shared``); each cache equals the one
that setting alone produces, tensor for tensor.

Attention weights (``Method.needs_attention_weights``, kvpress's ``attentions``): ``LayerContext.
attention_weights()`` gives the pass's softmax rows ``[b, H, q, L]`` once per layer for every setting asking.
With eager attention they are the module's own output (the hook reads it; nothing is computed again). sdpa and
flash attention return none: the attention runs as it is, and its weights are computed again from the module's
own queries (its ``q_proj`` output, kept until it returns) and the layer's keys, as eager computes them (``QK^T``
times the module's scaling, masked, softmax in float32, cast to the model dtype), one block of query rows at a
time so that only one block is ever in float32. What it costs beside sdpa: one more ``QK^T`` and softmax over
every query, and one ``[b, H, q, L]`` tensor in the model dtype (eager's own ``L x L`` weights), freed as soon
as that layer is compressed, so never more than one layer's. The weights equal eager's given the same queries
and keys; the queries and keys themselves are the sdpa model's (they differ from an eager model's by rounding).

A method reading the question's length (``Method.needs_question_length``) is told it per prefill
(``compress(..., question_tokens=)``, ``session.question_tokens``); one re-rotating its kept keys
(``Method.rerotates_keys``) has them moved to positions ``0..n-1`` right after its cut (``snapkv.rerotation``), and
its cache continues at position ``n`` once the prefill is over (``CacheState.renumber``).

Each cache carries its state (``snapkv.cache_state``, with the table of its lifecycle); every
place where transformers must be worked around is in ``snapkv.transformers_workarounds``.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import DynamicCache

from .architectures import (AttentionForm, attention_of, check_supported, decoder_layers, keep_queries, reading,
                            rotates_as_llama, stop_keeping, window_queries)
from .cache_state import CacheState, set_state, speculating, state_of, tokens_before_cut
from .channels import KeyChannelLayer
from .decoding_cuts import DecodingBuffer, check_buffer, cut_heads, due, gather_slots, in_score_order, ranked_slots
from .errors import InputError, check_bool
from .method import TIE_TOLERANCE, Method
from .prefill import PREFILL_CHUNK, ChunkedPrefill, check_chunk
from .ragged import HEADWISE_ATTENTION, RaggedLayer, pack_heads
from .rerotation import rerotated_keys
from .select import as_form, attention_softmax, model_logits, outside_window
from .timing import Clock, Ledger
from .wrapping import narrowed
from .transformers_workarounds import (RAGGED_ATTENTION, RepeatedKVLayer, cache_argument, check_cache, checked_generate,
                                       filled_layer, filled_sliding_layer, kv_groups_for, repeated_prefix,
                                       route_attention, takes_ragged_attention)


@dataclass
class LayerContext:
    """What a method's ``score`` may look at for one layer at the end of prefill."""

    attn: torch.nn.Module
    hidden_states: torch.Tensor
    position_embeddings: tuple
    keys: torch.Tensor
    values: torch.Tensor
    pad_mask: torch.Tensor | None
    layer_idx: int
    num_layers: int
    kept_queries: torch.Tensor | None = None       # every row's queries as the module's own call attended with
    memo: dict = field(default_factory=dict)       # them, for a method reading every query (``reads_every_query``)
    rotary: torch.nn.Module | None = None          # the model's rotary embedding (RoPE at any position)
    clock: Clock | None = None                     # times each shared score (``spans``) for the settings' costs
    spans: dict = field(default_factory=dict)      # key -> the span its computation took
    reads: set = field(default_factory=set)        # keys the setting compressed now has read
    weights: torch.Tensor | None = None            # the module's own attention weights (eager), for a method
    #                                                asking (``Method.needs_attention_weights``)
    decoding: object = None                        # the setting cutting the cache while decoding (its buffer of
    #                                                decoded tokens is ``hidden_states``)
    question_tokens: int | None = None             # how many of the prompt's last tokens are its question, for a
    #                                                method asking (``Method.needs_question_length``)
    pass_tokens: int = 0                           # tokens of this pass (the whole prompt at a prefill), of which
    #                                                ``hidden_states`` holds the last rows (every one unless the
    #                                                settings read fewer: ``Method.prefill_rows``); 0: as many as
    #                                                ``hidden_states`` has

    def __post_init__(self):
        if not self.pass_tokens:
            self.pass_tokens = self.hidden_states.shape[1]

    def shared(self, key, compute):
        """``compute()`` once per layer and prefill for every setting asking with the same ``key``
        (the key must name every input besides this layer's own tensors)."""
        if key not in self.memo:
            started = self.clock.start() if self.clock is not None else None
            self.memo[key] = compute()
            if self.clock is not None:
                self.spans[key] = self.clock.stop(started)
        self.reads.add(key)
        return self.memo[key]

    def queries(self, n: int) -> torch.Tensor:
        if self.decoding is not None:
            check_buffer(self.decoding, self.hidden_states.shape[1], n)
        return self.shared(("queries", n), lambda: self._queries(n))

    def _queries(self, n: int) -> torch.Tensor:
        kept = self.kept_queries
        if kept is not None and n == kept.shape[-2]:
            self.kept_queries = None  # every row: the module's own, held no longer than this
            return kept
        # a window: the module's own computation on exactly these rows (snapkv.architectures.module_call; a slice
        # of the whole pass's product could round otherwise, and the selections made so far would change)
        return window_queries(self.attn, self.hidden_states, self.position_embeddings, n)

    def attention_weights(self) -> torch.Tensor:
        """``[b, H, q, L]``: the softmax of every query of this pass (``q`` rows: the whole prompt at a prefill)
        over the layer's ``L`` keys, in the model dtype, as eager attention computes them; once per layer for
        every setting asking (``Method.needs_attention_weights``): the module's own where it returned them
        (eager), else computed again (``eager_attention_weights``)."""
        return self.shared(("attention_weights",), self._attention_weights)

    def _attention_weights(self) -> torch.Tensor:
        q_len, (b, _, length, _) = self.hidden_states.shape[1], self.keys.shape
        own, self.weights = self.weights, None  # held no longer than this
        if own is not None and own.shape[0] == b and own.shape[-2:] == (q_len, length):
            return own
        return eager_attention_weights(self.queries(q_len), self.keys, self.pad_mask, self.form)

    @property
    def form(self) -> AttentionForm:
        """How the layer turns scores into attention (scaling, soft-capping, sinks), as its module calls it."""
        return reading(self.attn).form

    @property
    def scaling(self) -> float | None:
        """The attention module's own score scaling (None: 1/sqrt(head_dim))."""
        return self.form.scaling


# query rows per block of ``eager_attention_weights`` (its float32 softmax is one block's): small on a CPU, where
# a block stays in cache between the matmul and the softmax, large on a GPU (fewer kernel launches)
_WEIGHT_ROWS, _CPU_WEIGHT_ROWS = 1024, 128


def eager_attention_weights(queries: torch.Tensor, keys: torch.Tensor, pad_mask: torch.Tensor | None = None,
                            scaling: float | AttentionForm | None = None) -> torch.Tensor:
    """``[b, H, q, L]`` in the queries' dtype: the attention weights eager attention computes for ``queries``
    (``[b, H, q, d]``, post-RoPE, the last ``q`` of the ``L`` positions) over ``keys`` (``[b, kv_heads, L, d]``):
    the keys repeated to every query head of their group, ``QK^T`` as the layer's ``AttentionForm`` makes logits
    (``scaling``, None: ``1/sqrt(d)``; soft-capping), each query blind to later keys, to keys outside its sliding
    window and to padded ones (``pad_mask`` ``[b, L]``), softmax in float32 (with the layer's sinks), cast back.
    Query rows go by blocks; a masked score is set to the dtype's lowest where eager adds it (either way its
    weight is an exact 0), so the weights are eager's bit for bit given the same queries and keys."""
    b, n_heads, q_len, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    form = as_form(scaling)
    if form.scaling is None:  # eager multiplies by the module's 1/sqrt(d)
        form = replace(form, scaling=d ** -0.5)
    repeated = keys[:, :, None].expand(b, n_kv, n_heads // n_kv, length, d).reshape(b, n_heads, length, d)
    out = torch.empty(b, n_heads, q_len, length, dtype=queries.dtype, device=queries.device)
    key_pos = torch.arange(length, device=queries.device)
    hidden_keys = None if pad_mask is None or pad_mask.shape[-1] != length else ~pad_mask[:, None, None, :]
    sinks = None if form.sinks is None else form.sinks.view(1, n_heads, 1, 1)
    lowest = torch.finfo(queries.dtype).min
    rows = _CPU_WEIGHT_ROWS if queries.device.type == "cpu" else _WEIGHT_ROWS
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        scores = model_logits(torch.matmul(queries[:, :, start:end], repeated.transpose(2, 3)), d, form)
        query_pos = torch.arange(start, end, device=queries.device) + (length - q_len)
        scores.masked_fill_(key_pos[None, :] > query_pos[:, None], lowest)
        older = outside_window(query_pos, key_pos, form.sliding_window)
        if older is not None:
            scores.masked_fill_(older, lowest)
        if hidden_keys is not None:
            scores.masked_fill_(hidden_keys, lowest)
        out[:, :, start:end] = attention_softmax(scores, sinks)
    return out


@dataclass
class Replay:
    """What a method scoring after the prefill (``Method.scores``, KVzip's context replay) may use."""

    model: torch.nn.Module
    layers: list                 # the decoder layers
    decoder: torch.nn.Module     # the decoder stack (``model.model``): a pass without the LM head
    load_tokenizer: object       # () -> the model's tokenizer, or None where there is none

    @property
    def tokenizer(self):
        return self.load_tokenizer()


class CompressionSession:
    """Hooks that apply one compressor config to one model; ``compress()`` attaches and detaches it."""

    def __init__(self, model, cfg, compress_later_turns: bool = False, tokenizer=None, question_tokens=None,
                 record_scores: bool | float = False, prefill_chunk: int | None = PREFILL_CHUNK,
                 compress_sliding: bool = False):
        cfgs = list(cfg) if isinstance(cfg, (list, tuple)) else [cfg]
        if not cfgs:
            raise InputError("cfg=[]: give at least one compressor config")
        for one in cfgs:
            if not isinstance(one, Method):
                raise InputError(f"cfg={type(one).__name__} is not a compressor config (SnapKV, H2O, ...)")
        check_supported(model)
        limit = getattr(model.config, "max_position_embeddings", None)
        for one in cfgs:
            if one.compresses and limit and one.ratio is None and one.budget > limit:
                raise InputError(f"budget={one.budget} is larger than the model's context "
                                 f"(max_position_embeddings={limit})")
        self.model, self.cfgs, self.cfg = model, cfgs, cfgs[0]
        self.compress_later_turns = compress_later_turns
        for one in cfgs:
            if compress_later_turns and (one.needs_question_length or one.rerotates_keys):
                raise InputError(f"{one.method}: compress_later_turns=True is not supported (its window is the first "
                                 "prompt's question and its keys are re-rotated); leave it False")
        self.tokenizer = tokenizer  # for a method with prompts of its own (KVzip's reconstruction)
        # keep each cut layer's ``Method.ranking_scores`` and bounds (snapkv.ranking_scores): True, or the tolerance
        self.record_scores = recording_tolerance(record_scores)
        # prefills run layer by layer in chunks of this many tokens (snapkv.prefill); None: the model's own pass
        self.prefill_chunk = check_chunk(prefill_chunk)
        # sliding-window layers hold what the model's own sliding cache holds (its last window - 1 tokens); True:
        # they are compressed too, within that window (docs/library.md)
        check_bool("compress_sliding", compress_sliding)
        self.compress_sliding = compress_sliding
        self._chunked: ChunkedPrefill | None = None
        # how many of the next prefills' last tokens are the question (``Method.needs_question_length``): set it
        # before each prefill whose question length differs (the runner does, per prompt)
        self.question_tokens = question_tokens
        self.layers = decoder_layers(model)
        self._rotary = getattr(self.decoder, "rotary_emb", None)
        slides = any(reading(attention_of(layer)).form.sliding_window is not None for layer in self.layers)
        for one in cfgs:
            if one.compresses and (one.rerotates_keys or one.scores_after_prefill) and slides:
                what = ("re-rotated keys need every layer cut to the same tokens" if one.rerotates_keys else
                        "its replay scores every layer's whole prompt after the prefill")
                raise InputError(f"{one.method}: {what}, which the sliding-window layers of "
                                 f"model_type={model.config.model_type!r} do not hold")
            if one.compresses and one.rerotates_keys:
                check_rerotation(one, self.layers, self._rotary)
        self.state: CacheState | None = None  # of the latest prefill (cache_lengths)
        self.caches: list = []                # of the latest prefill, one per setting
        self.compression = Ledger()           # of the latest prefill: every setting's compression, shared work once
        self._handles: list = []
        self._groups = {}
        self._attention = model.config._attn_implementation  # restored after a call routed elsewhere
        # a method reading the attention weights (ObservedAttention) takes the module's own where it returns them
        self._keeps_weights = any(one.needs_attention_weights for one in cfgs)
        # a method scoring every query (H2O) reads the prompt's queries as the module handed them to its attention
        self._keeps_queries = any(one.reads_every_query or one.needs_attention_weights for one in cfgs)
        self._kept_queries: dict = {}
        self._generate = None
        for one in cfgs:  # what a method fixes once per model (``Method.prepare``), before any hook is attached
            if one.compresses:
                with torch.no_grad():
                    one.prepare(self.replay)

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> None:
        base = self.decoder
        self._handles.append(base.register_forward_pre_hook(self._before_decoder, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after_decoder, with_kwargs=True))
        for layer in self.layers:
            attn = attention_of(layer)
            probe = reading(attn)
            self._groups[attn] = getattr(attn, "num_key_value_groups", probe.query_heads // probe.kv_heads)
            self._handles.append(attn.register_forward_pre_hook(self._before_attention, with_kwargs=True))
            self._handles.append(attn.register_forward_hook(self._after_attention, with_kwargs=True))
        if self.prefill_chunk is not None:
            self._chunked = ChunkedPrefill(self.model, self.decoder, self.layers, self.prefill_chunk)
            self._chunked.attach()
        if hasattr(self.model, "generate"):
            self._generate = self.model.generate
            self.model.generate = checked_generate(self.model, self._generate, self._speculation_refused,
                                                   speculating, tokens_before_cut)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for layer in self.layers:  # a pass that raised midway
            stop_keeping(attention_of(layer))
        self._kept_queries.clear()
        if self._chunked is not None:
            self._chunked.detach()
            self._chunked = None
        for attn, groups in self._groups.items():
            if hasattr(attn, "num_key_value_groups"):
                attn.num_key_value_groups = groups
            if attn.config._attn_implementation in (RAGGED_ATTENTION, HEADWISE_ATTENTION):  # raised midway
                route_attention(attn, self._attention)
        if self._generate is not None:
            del self.model.generate  # the class method is back
            self._generate = None

    def _speculation_refused(self) -> str | None:
        """Why this session's caches cannot follow speculative decoding's crops (None: they can)."""
        if self.compress_later_turns:
            return ("speculative decoding: compress_later_turns=True would compress each verification pass, drafts "
                    "included; leave it False")
        return None

    @property
    def cache_lengths(self) -> list[int]:
        """Tokens per head each layer kept at the last prefill (the first setting's)."""
        return self.lengths_per_setting[0] if self.caches else []

    @property
    def lengths_per_setting(self) -> list[list[int]]:
        """Per setting, in the order given, the tokens per head each layer kept at the last prefill."""
        return [state_of(cache).lengths() for cache in self.caches]

    def compression_seconds(self) -> tuple[list[float], float]:
        """After the last prefill (read once the device has finished it): per setting, the seconds its
        compression took as its solo run pays them (a score several settings share counts for each of
        them), and the seconds every compression of the prefill took together (shared work once); the
        prefill pass itself is its time less the latter."""
        return [state_of(cache).compression.total() for cache in self.caches], self.compression.total()

    # -- decoder-level hooks ----------------------------------------------------------------
    def _before_decoder(self, module, args, kwargs):
        if self._chunked is not None:
            self._chunked.end()  # a pass that raised midway left its chunks behind
        cache = cache_argument(kwargs)
        if cache is not None:
            repeated_prefix(cache, kwargs)
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        q_len = tokens.shape[1]
        created = cache is None and self._wants_cache(module, kwargs)
        if created:  # the cache the model would create itself: made here, so it is compressed like any other
            kwargs.pop("past_key_values", None)
            cache = kwargs["cache"] = DynamicCache(config=self.model.config)
        if cache is None:
            return None  # use_cache=False: nothing is stored, nothing to compress
        check_cache(cache)
        state = state_of(cache)
        if state is None:
            if cache.get_seq_length() != 0:
                return None  # a cache filled outside this session: left as it is
            state = self._start_prefill(kwargs, q_len, tokens)
            set_state(cache, state)
            self.state = state
            self.caches = [cache] + [sibling for sibling, _ in state.siblings]
            self.compression = Ledger()
            if self._chunked is not None and q_len > 1 and self._chunked.takes(kwargs, module.config):
                self._chunked.begin(kwargs, tokens, self._prefill_tail(q_len, state.question_tokens))
                return args, kwargs
            return (args, kwargs) if created else None
        if not state.compressed:  # e.g. full KV, or a prompt within the budget: a plain cache
            state.advance(q_len)
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.ndim != 2:
            raise InputError("attention_mask: a 4-D mask cannot follow a compressed cache; pass the 2-D padding mask")
        if self.compress_later_turns and q_len > 1 and state.head_adaptive:
            raise InputError(f"{state.cfg.method}: a head-adaptive cache cannot compress a later turn "
                             "(compress_later_turns=False appends it as it is)")
        positions, kwargs["attention_mask"] = state.begin_pass(q_len, self.compress_later_turns)
        if kwargs.get("position_ids") is None or state.renumbered:
            # re-rotated keys (Method.rerotates_keys): the cache's own positions, n onwards, whatever the caller
            # counted (generate counts from the prompt's length)
            kwargs["position_ids"] = positions
        # no kept padding: causal masking is right for every layer, whatever its length (a
        # multi-token continuation gets a per-layer mask in _before_attention)
        return args, kwargs

    def _prefill_tail(self, q_len: int, question_tokens: int | None) -> int | None:
        """How many of the prompt's last rows the settings read the layer input of (``Method.prefill_rows``): the
        chunked prefill's last chunk is at least that long; None: every row (one chunk)."""
        rows = [cfg.prefill_rows(q_len, question_tokens) if cfg.compresses else 0 for cfg in self.cfgs]
        return None if any(r is None for r in rows) else max(rows)

    @staticmethod
    def _wants_cache(module, kwargs) -> bool:
        """Whether a pass given no cache makes one (``use_cache``, else the model config's default)."""
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", True)
        return bool(use_cache)

    def _start_prefill(self, kwargs, q_len: int, tokens) -> CacheState:
        mask = kwargs.get("attention_mask")
        pad_mask = None
        if mask is not None:
            if mask.ndim != 2:
                raise InputError("attention_mask: pass the 2-D padding mask [batch, length], not a 4-D mask")
            if not bool(mask.all()):
                pad_mask = mask.bool()
                n_layers = len(self.layers)
                for cfg in self.cfgs:
                    if cfg.compresses and len({min(q_len, cfg.layer_budget(i, n_layers, q_len))
                                               for i in range(n_layers)}) > 1:
                        raise InputError(f"{cfg.method}: per-layer budgets need a batch without padding "
                                         "(attention_mask has zeros); run batch size 1")
        positions = kwargs.get("position_ids")
        if positions is not None:
            next_positions = positions[:, -1] + 1
        else:
            next_positions = torch.full((1,), q_len, dtype=torch.long)
        next_positions = next_positions.to(tokens.device).expand(tokens.shape[0]).clone()

        ids = tokens if not tokens.is_floating_point() else None  # inputs_embeds: no ids
        for cfg in self.cfgs:
            if cfg.scores_after_prefill and (ids is None or pad_mask is not None or ids.shape[0] != 1):
                raise InputError(f"{cfg.method}: one prompt of token ids without padding (batch size 1, "
                                 "input_ids): its replay repeats the prompt's tokens, as kvpress's press does")
        question = self._question_length(q_len, pad_mask)

        def state(cfg):
            one = CacheState.for_prefill(cfg, pad_mask, next_positions, q_len)
            one.prompt_ids = ids if cfg.scores_after_prefill else None
            one.question_tokens = question
            return one
        first = state(self.cfgs[0])
        first.siblings = [(DynamicCache(config=self.model.config), state(cfg)) for cfg in self.cfgs[1:]]
        for sibling, sibling_state in first.siblings:
            set_state(sibling, sibling_state)
        return first

    def _question_length(self, q_len: int, pad_mask) -> int | None:
        """The prompt's question length for the settings asking (``Method.needs_question_length``), checked."""
        asking = [cfg for cfg in self.cfgs if cfg.compresses and (cfg.needs_question_length or cfg.rerotates_keys)]
        if asking and pad_mask is not None:
            raise InputError(f"{asking[0].method}: a left-padded batch cannot be compressed (one question length per "
                             "prompt, re-rotated keys per row); prefill the prompts one at a time")
        question = self.question_tokens
        if not any(cfg.needs_question_length for cfg in asking):
            return question
        if question is None:
            name = next(cfg.method for cfg in asking if cfg.needs_question_length)
            raise InputError(f"{name}: the question's length is not known; pass snapkv.compress(model, cfg, "
                             "question_tokens=N) or set session.question_tokens = N before the prefill "
                             "(N: how many of the prompt's last tokens are the question)")
        if isinstance(question, bool) or not isinstance(question, int) or not 0 < question < q_len:
            raise InputError(f"question_tokens={question!r} must be an integer in [1, {q_len - 1}]: how many of the "
                             f"prompt's last tokens (of {q_len}) are the question, at least one before it")
        return question

    def _after_decoder(self, module, args, kwargs, output):
        if self._chunked is not None:
            self._chunked.end()
        cache = cache_argument(kwargs)
        state = state_of(cache) if cache is not None else None
        if state is None:
            return
        waiting = [(c, s) for c, s in [(cache, state), *state.siblings]
                   if s.in_prefill and s.cfg.scores_after_prefill and s.prompt_ids is not None]
        state.end_pass()
        state.finish_decoding_cuts(cache)
        if waiting:
            self._cut_after_prefill(waiting)

    def _cut_after_prefill(self, waiting: list) -> None:
        """Methods that score once the whole prompt has been prefilled (KVzip): their caches still hold
        every layer whole; each distinct scoring runs once for all its settings (KVzip's replay for every
        ratio), then each cache keeps what its setting keeps."""
        scored, spans = {}, {}
        for cache, state in waiting:
            cfg = state.cfg
            full = [(layer.keys, layer.values) for layer in cache.layers]
            clock = Clock(full[0][0].device)
            if cfg.replay_key() not in scored:
                started = clock.start()
                with torch.no_grad():
                    scored[cfg.replay_key()] = cfg.scores(self.replay, full, state.prompt_ids)
                spans[cfg.replay_key()] = clock.stop(started)
                self.compression.add(spans[cfg.replay_key()])
            state.compression.add(spans[cfg.replay_key()])  # each setting of a replay pays it, as alone
            started = clock.start()
            self._cut_scored(cache, state, full, scored[cfg.replay_key()])
            cut = clock.stop(started)
            state.compression.add(cut)
            self.compression.add(cut)

    def _cut_scored(self, cache, state: CacheState, full: list, scored) -> None:
        """Keep what ``state``'s setting keeps of every layer of ``cache`` given its replay's scores."""
        cfg = state.cfg
        for idx, (kept, valid) in enumerate(cfg.cut(scored)):
            keys, values = full[idx]
            if bool(valid.all()):
                if kept.shape[-1] == keys.shape[-2]:  # nothing cut: the layer stays as it is
                    continue
                valid = None  # every head keeps as many: a uniform layer
            per_head = kept.shape[-1] if valid is None else int(valid.sum(dim=-1).float().mean().item())
            self._store(cache, state, idx, keys, values, kept, valid, per_head,
                        self._groups[attention_of(self.layers[idx])])
        state.prompt_ids = None  # scored once
        if state.compressed:  # cut after the pass ended: no crop may reach into the prompt
            state.crop_floor = state.consumed

    @property
    def replay(self) -> Replay:
        return Replay(self.model, self.layers, self.decoder, self.model_tokenizer)

    @property
    def decoder(self):
        """The model's decoder stack (``model.model``): a pass without the LM head."""
        return getattr(self.model, "base_model", self.model)

    def model_tokenizer(self):
        """The tokenizer a method's own prompts need (KVzip's): the one given to ``compress``, else the
        model's folder's, as kvpress loads it (None where there is none)."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(self.model.config.name_or_path)
            except (OSError, ValueError, TypeError):
                return None
        return self.tokenizer

    # -- attention-level hooks --------------------------------------------------------------
    def _before_attention(self, module, args, kwargs):
        cache = cache_argument(kwargs)
        if cache is None or module.layer_idx >= len(cache.layers):
            return None
        if hasattr(module, "num_key_value_groups"):  # (a module repeating no keys, GPT-NeoX's, has none)
            module.num_key_value_groups = kv_groups_for(cache.layers[module.layer_idx], self._groups[module])
        state = state_of(cache)
        if state is not None and state.in_prefill and self._keeps_queries:
            keep_queries(module, lambda query: self._kept_queries.__setitem__(module, query))
        if state is None or not state.compressed:
            return None
        layer = cache.layers[module.layer_idx]
        own_layout = getattr(layer, "attends_itself", False)  # each head its own slots (snapkv.ragged), fewer key
        if state.in_prefill:                                   # channels (snapkv.channels)
            if own_layout:  # a later turn to compress (compress_later_turns): its keys cannot be scored with these
                raise InputError(f"{state.cfg.method}: a cache whose layers store a layout of their own cannot "
                                 "compress a later turn (compress_later_turns=False appends it as it is)")
            return None
        if own_layout:  # the layer's own attention, whatever the model's; undone after
            route_attention(module, HEADWISE_ATTENTION)
            kwargs["attention_mask"] = None
            kwargs["snapkv_layer"], kwargs["snapkv_kernel"] = layer, self._attention
            kwargs["snapkv_visible"] = state.kept_mask  # the kept padding of a left-padded batch
            return args, kwargs
        if module.config._attn_implementation == "flash_attention_2":
            return None  # its causal masking aligns the new tokens to the end of each layer's keys
        ragged = state.layer_segments is not None and state.query_len == 1 and takes_ragged_attention(module.config)
        if ragged:  # merged caches: each member over its own slots, undone in _after_attention
            route_attention(module, RAGGED_ATTENTION)
            kwargs["attention_mask"] = None
            kwargs["snapkv_segments"] = state.layer_segments[module.layer_idx]
            return args, kwargs
        # The model sized its mask for one layer; layers hold different lengths (PyramidKV, later
        # turns), so each layer gets its own: none for one new token without kept padding.
        if state.query_len == 1 and state.kept_mask is None and state.layer_masks is None:
            kwargs["attention_mask"] = None
        else:
            kwargs["attention_mask"] = self._continuation_mask(state, layer, kwargs, module.layer_idx)
        return args, kwargs

    @staticmethod
    def _continuation_mask(state: CacheState, layer, kwargs, layer_idx: int) -> torch.Tensor:
        """``[b, 1, q, L + q]`` additive mask for ``q`` new tokens after a layer holding ``L``: every
        kept token visible (but kept padding, and the padding of merged caches), causal among the new ones."""
        hidden = kwargs["hidden_states"]
        q, length = state.query_len, layer.keys.shape[-2]
        if getattr(layer, "is_sliding", False):  # one recording its past (speculating) attends its window only
            length = min(length, layer.sliding_window - 1)
        visible = torch.ones(hidden.shape[0], q, length + q, dtype=torch.bool, device=hidden.device)
        visible[:, :, length:] = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
        if getattr(layer, "is_sliding", False):  # the model's sliding layer: its window, counted from each query
            keys_at = torch.arange(length + q, device=hidden.device)
            visible &= ~outside_window(keys_at[length:], keys_at, layer.sliding_window)
        if state.kept_mask is not None:
            visible[:, :, :length] &= state.kept_mask[:, None, :length]
        if state.layer_masks is not None:
            merged = state.layer_masks[layer_idx]  # the slots tokens decoded since the merge follow are real
            visible[:, :, :merged.shape[1]] &= merged[:, None, :]
        visible = visible[:, None]
        blocked = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
        return blocked.masked_fill(~visible, torch.finfo(hidden.dtype).min)

    def _after_attention(self, module, args, kwargs, output):
        stop_keeping(module)
        kept_queries = self._kept_queries.pop(module, None)
        if "snapkv_segments" in kwargs or "snapkv_layer" in kwargs:
            route_attention(module, self._attention)
        cache = cache_argument(kwargs)
        state = state_of(cache) if cache is not None else None
        if state is None:
            return None
        if not state.in_prefill:
            if state.cfg is not None and state.cfg.decodes and not self._keeps_whole(module):
                self._decoding_pass(module, args, kwargs, cache, state)
            return None
        chunked = self._chunked.running if self._chunked is not None else None
        if chunked is not None and not chunked.last:
            return None  # the layer's keys are not all written yet: it is compressed after its last chunk
        idx = module.layer_idx
        layer = cache.layers[idx]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        weights = None
        if self._keeps_weights and isinstance(output, tuple) and len(output) > 1 and torch.is_tensor(output[1]):
            weights = output[1]  # eager attention's own (sdpa and flash return None)
        ctx = LayerContext(module, hidden, kwargs["position_embeddings"], layer.keys, layer.values, state.pad_mask,
                           idx, len(self.layers), kept_queries, rotary=self._rotary, clock=Clock(layer.keys.device),
                           weights=weights, question_tokens=state.question_tokens,
                           pass_tokens=chunked.length if chunked is not None else 0)
        # the siblings first: the first setting's own cache layer is replaced last
        for target, target_state in [*state.siblings, (cache, state)]:
            known, ctx.reads = set(ctx.spans), set()
            started = ctx.clock.start()
            self._compress_layer(ctx, target, target_state)
            span = ctx.clock.stop(started)
            self.compression.add(span)
            # as its solo run pays: a shared score this setting computed counts once, like any it read
            ledger = target_state.compression
            ledger.add(span)
            for key in set(ctx.spans) - known:
                ledger.add(ctx.spans[key], -1)
            for key in ctx.reads:
                ledger.add(ctx.spans[key])
        return None

    def _decoding_pass(self, module, args, kwargs, cache, state: CacheState) -> None:
        """A pass after the prefill of a setting that cuts while decoding (``Method.decodes``,
        ``snapkv.decoding_cuts``): buffer this layer's hidden states and, every ``decode_interval`` tokens, cut
        the layer back to the setting's target by its own ``select``. A pass verifying drafts (``speculating``)
        only buffers: the cut waits for the crop that drops the rejected ones (``_settle_cuts``)."""
        cfg, idx = state.cfg, module.layer_idx
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        buffer = state.decoding.setdefault(idx, DecodingBuffer())
        buffer.add(hidden, kwargs["position_embeddings"])
        if state.speculating and hidden.shape[1] > 1:
            if buffer.steps > cfg.decode_interval:
                raise InputError(f"{cfg.method}: a verification pass of {hidden.shape[1]} tokens crosses the cut "
                                 f"due after {cfg.decode_interval - buffer.steps + hidden.shape[1]} more; draft at "
                                 "most snapkv.tokens_before_cut(cache) - 1 tokens")
            state.pending_cuts = partial(self._settle_cuts, state=state)
            return
        self._cut_if_due(module, cache, state, buffer)

    def _settle_cuts(self, cache, state: CacheState) -> None:
        """After a verification pass's crop: the cuts its accepted tokens made due, layer by layer, as plain decoding
        cut them at the end of the pass that reached the count."""
        for layer in self.layers:
            attn = attention_of(layer)
            buffer = state.decoding.get(attn.layer_idx)
            if buffer is not None:
                self._cut_if_due(attn, cache, state, buffer, by_pass=False)
        state.finish_decoding_cuts(cache)

    def _cut_if_due(self, module, cache, state: CacheState, buffer: DecodingBuffer, by_pass: bool = True) -> None:
        cfg, idx = state.cfg, module.layer_idx
        if not by_pass:  # after a verification pass: what plain decoding's buffer held at the end of its last pass
            buffer.trim(cfg.decode_buffer + 1)
        if due(cfg, buffer, by_pass):
            layer = cache.layers[idx]
            length = layer.get_seq_length() if isinstance(layer, RaggedLayer) else layer.keys.shape[-2]
            target = cfg.decoding_target(int(state.next_positions.max()))
            if length > target:
                clock = Clock(layer.keys.device)
                started = clock.start()
                self._cut_while_decoding(module, cache, state, buffer, target)
                span = clock.stop(started)
                state.decoding_seconds.add(span)
            buffer.restart()
        buffer.trim(cfg.decode_buffer)

    def _cut_while_decoding(self, module, cache, state: CacheState, buffer: DecodingBuffer, target: int) -> None:
        idx, layer = module.layer_idx, cache.layers[module.layer_idx]
        cut = state.cfg.for_decoding(target)
        hidden, (cos, sin) = buffer.tokens(state.cfg.decode_query_positions)
        if isinstance(layer, RaggedLayer):  # a head-adaptive cache: each head's slots scored on their own
            def context(row, keys, values):
                return LayerContext(module, hidden[row:row + 1], (cos[row:row + 1], sin[row:row + 1]), keys, values,
                                    None, idx, len(self.layers), rotary=self._rotary, decoding=state.cfg)
            with torch.no_grad():
                cache.layers[idx] = cut_heads(cut, layer, context, target, state.consumed)
            state.record_headwise_cut(idx, target)
            return
        length = layer.keys.shape[-2]
        window = min(cut.recent_window(idx, len(self.layers), length), target)
        real = state.pad_mask if state.pad_mask is not None and state.pad_mask.shape[-1] == length else None
        ctx = LayerContext(module, hidden, (cos, sin), layer.keys, layer.values, real, idx, len(self.layers),
                           rotary=self._rotary, decoding=state.cfg)
        with torch.no_grad():
            if cut.scores_positions and not cut.head_adaptive:  # kvpress's order: as the scores rank the slots
                scores = cut.prompt_scores(ctx)
                kept = ranked_slots(scores, target, real)
                if self.record_scores:
                    state.record_decoding_ranking(idx, scores, cut.ranking_bounds(ctx, scores, self.record_scores),
                                                  kept)
            else:
                kept, valid = cut.select(ctx, target, window)
                if valid is not None:  # the heads' own counts from now on
                    cache.layers[idx] = ragged_layer(state, idx, layer.keys, layer.values, kept, valid)
                    state.record_headwise_cut(idx, target)
                    return
            layer.keys, layer.values = gather_slots(layer.keys, layer.values, kept)
        state.record_decoding_cut(idx, kept, length, target)

    def _keeps_whole(self, attn) -> bool:
        """Whether the layer is a sliding-window one left as the model's own sliding cache holds it."""
        return reading(attn).form.sliding_window is not None and not self.compress_sliding

    def _compress_layer(self, ctx: LayerContext, cache, state: CacheState) -> None:
        """Store ``ctx``'s layer, compressed by the cache's setting, as that cache's layer."""
        sliding = ctx.form.sliding_window
        if sliding is not None:
            if state.cfg.compresses and state.pad_mask is not None:
                raise InputError(f"{state.cfg.method}: a left-padded batch cannot be compressed on a model with "
                                 "sliding-window layers (they hold each row's last tokens, padding included); "
                                 "prefill the prompts one at a time")
            held = min(sliding - 1, state.consumed)
            seen = torch.arange(state.consumed - held, state.consumed, dtype=torch.int32, device=ctx.keys.device)
            if self._keeps_whole(ctx.attn) or not state.cfg.compresses:
                cache.layers[ctx.layer_idx] = filled_sliding_layer(ctx.keys, ctx.values, sliding, state.consumed)
                state.prompt_slots[ctx.layer_idx] = seen.expand(ctx.keys.shape[0], ctx.keys.shape[1], held)
                state.prompt_length = state.consumed
                state.record_layer(ctx.layer_idx, held)
                return
            # compress_sliding: the layer's window alone is compressed (its slots labelled with their positions)
            state.prompt_slots[ctx.layer_idx] = seen.expand(ctx.keys.shape[0], ctx.keys.shape[1], held)
            ctx = within_window(ctx, held)
        idx, keys, values = ctx.layer_idx, ctx.keys, ctx.values
        length = keys.shape[-2]
        cfg = state.cfg
        budget = cfg.layer_budget(idx, ctx.num_layers, length) if cfg.compresses else length
        if length <= budget and not (cfg.compresses and cfg.stores_key_channels):
            if cache.layers[idx].keys is not keys:
                cache.layers[idx] = filled_layer(keys, values)
            state.record_layer(idx, length)
            return
        window = cfg.recent_window(idx, ctx.num_layers, length)
        if ctx.pass_tokens < window:
            raise InputError(f"{cfg.method}: a later turn of {ctx.pass_tokens} tokens is shorter than "
                             f"window={window}; it cannot be compressed "
                             "(compress_later_turns=False appends it as it is)")
        with torch.no_grad():
            kept, valid = cfg.select(ctx, budget, window)
            if cfg.decodes and cfg.scores_positions and valid is None and ctx.pad_mask is None:
                kept = in_score_order(cfg.prompt_scores(ctx), kept)  # as the cuts while decoding leave it
            channels = cfg.key_channels(ctx)  # None: every key channel
            if self.record_scores:
                scores = cfg.ranking_scores(ctx)
                bounds = None if scores is None else cfg.ranking_bounds(ctx, scores, self.record_scores)
                state.record_ranking_scores(idx, scores, bounds, cfg.head_adaptive)
        self._store(cache, state, idx, keys, values, kept, valid, budget, self._groups[ctx.attn], channels)
        if cfg.rerotates_keys:
            self._rerotate(cache.layers[idx], state, idx, kept, valid, channels, ctx.rotary,
                           reading(ctx.attn).rotates)

    @staticmethod
    def _rerotate(layer, state: CacheState, idx: int, kept, valid, channels, rotary, rotates: bool = True) -> None:
        """``Method.rerotates_keys``: the layer's kept keys (just stored, at the prompt positions ``kept``) moved to
        positions ``0..n-1``; the cache continues at ``n`` once the prefill is over (``CacheState.end_pass``). A
        layer without RoPE (``rotates`` False) holds keys of no position: they stay as they are."""
        if valid is not None or channels is not None:
            raise InputError(f"{state.cfg.method}: re-rotated keys need a uniform cut of whole keys (every head the "
                             "same number of positions)")
        if bool((kept[..., 1:] <= kept[..., :-1]).any()):
            raise InputError(f"{state.cfg.method}: re-rotated keys need each head's kept positions ascending")
        if rotates:
            with torch.no_grad():
                layer.keys = rerotated_keys(layer.keys, kept, rotary)
        state.rerotated_layers.add(idx)

    @staticmethod
    def _store(cache, state: CacheState, idx: int, keys, values, kept, valid, budget: int, groups: int,
               channels=None) -> None:
        """Keep the positions ``kept`` (``valid``: which slots each head really keeps) of a layer holding
        ``keys``/``values`` as that cache's layer, and record what was kept; ``channels`` (``Method.key_channels``):
        the key channels each KV head keeps (``snapkv.channels``), None: every one."""
        length, kv_heads = keys.shape[-2], keys.shape[1]
        if valid is not None:  # head-adaptive: each head's own slots, packed
            with torch.no_grad():
                cache.layers[idx] = ragged_layer(state, idx, keys, values, kept, valid)
            state.head_adaptive = True
            state.prompt_length = state.consumed
        else:
            with torch.no_grad():
                if kept.shape[1] != kv_heads:  # gqa="repeat": one selection per query head
                    keys = keys.repeat_interleave(groups, dim=1)
                    values = values.repeat_interleave(groups, dim=1)
                if kept.shape[-1] == length:  # every position (kept ascending): nothing to gather
                    new_keys, new_values = keys, values
                else:
                    gather = kept[..., None].expand(-1, -1, -1, keys.shape[-1])
                    new_keys, new_values = keys.gather(2, gather), values.gather(2, gather)
                if channels is not None:  # fewer key channels: only those of the prompt's keys are stored
                    new_layer = KeyChannelLayer(new_keys, new_values, channels)
            current = cache.layers[idx]
            if channels is not None:
                cache.layers[idx] = new_layer
            elif kept.shape[1] != kv_heads:
                cache.layers[idx] = RepeatedKVLayer(new_keys, new_values, groups)
            elif isinstance(current, RepeatedKVLayer):  # a later turn of a gqa="repeat" cache
                current.keys, current.values = new_keys, new_values
            else:
                cache.layers[idx] = filled_layer(new_keys, new_values)
            state.record_kept(kept)
            state.record_slots(idx, kept, length)
            budget = kept.shape[-1]  # what each head really keeps (ChunkKV: whole chunks)
        state.record_layer(idx, budget)
        state.mark_compressed(cache)


def within_window(ctx: LayerContext, held: int) -> LayerContext:
    """``ctx`` narrowed to a sliding layer's last ``held`` keys (``compress_sliding``): what the layer holds."""
    rows = min(held, ctx.hidden_states.shape[1])
    cos, sin = ctx.position_embeddings
    return narrowed(ctx, keys=ctx.keys[:, :, -held:], values=ctx.values[:, :, -held:],
                    hidden_states=ctx.hidden_states[:, -rows:], position_embeddings=(cos[:, -rows:], sin[:, -rows:]),
                    pass_tokens=min(ctx.pass_tokens, held))


def check_rerotation(cfg, layers, rotary) -> None:
    """Re-rotated keys (``Method.rerotates_keys``) assume Llama's RoPE on every layer that rotates; one line for a
    model rotating otherwise (partial or interleaved RoPE), before any prefill."""
    for layer in layers:
        attn = attention_of(layer)
        if reading(attn).rotates and not rotates_as_llama(attn, rotary):
            raise InputError(f"{cfg.method}: re-rotated keys assume Llama's RoPE over every channel, and "
                             f"model_type={attn.config.model_type!r} rotates otherwise (partial or interleaved); "
                             "pass rerotate_keys=False")


def recording_tolerance(record_scores) -> float:
    """``compress(..., record_scores=)``: False (0: nothing recorded), True (``TIE_TOLERANCE``) or a tolerance."""
    if isinstance(record_scores, bool):
        return TIE_TOLERANCE if record_scores else 0.0
    if not isinstance(record_scores, (int, float)) or not 0 < record_scores < 1:
        raise InputError(f"record_scores={record_scores!r}: give True, False or a relative tolerance in (0, 1)")
    return float(record_scores)


def ragged_layer(state: CacheState, idx: int, keys, values, kept, valid) -> RaggedLayer:
    """A layer holding ``keys``/``values`` (``[rows, kv_heads, slots, d]``) cut head by head to ``kept``/``valid``,
    each slot labelled with the position it holds now (``CacheState.slot_positions``)."""
    held = state.slot_positions(idx, kept.shape[0], kept.shape[1], keys.shape[-2], kept.device)
    return RaggedLayer(*pack_heads(keys, values, kept, valid, held.gather(-1, kept.to(torch.int64))))


@contextmanager
def compress(model, cfg, compress_later_turns: bool = False, tokenizer=None, question_tokens: int | None = None,
             record_scores: bool | float = False, prefill_chunk: int | None = PREFILL_CHUNK,
             compress_sliding: bool = False):
    """Inside the context every prefill leaves each layer's cache compressed by ``cfg``.

    ``cfg`` may be a list of settings: a prefill then leaves one cache per setting, in that order
    (``session.caches``; the cache given to the model is the first), each equal to what the setting
    alone produces. Decode each from its own cache inside the context::

        with snapkv.compress(model, [SnapKV(budget=1024), FullKV()]) as session:
            out = model(ids, cache=DynamicCache(config=model.config))
            snap_cache, full_cache = session.caches

    A cache compressed here can be continued in the context: token by token, several tokens at a
    time, or a later turn through ``generate`` on the same cache (its tokens are appended at the
    right positions; ``compress_later_turns=True`` compresses a later turn's prompt too). ``tokenizer``:
    the model's, for a method that prompts the model itself (KVzip; else loaded from its folder).
    ``question_tokens``: how many of the prompt's last tokens are its question, for a method reading it
    (``Method.needs_question_length``, FINCH); it holds for every prefill until ``session.question_tokens`` is
    set to another value (set it before each prefill whose question length differs). ``record_scores``: keep the
    scores each cut layer ranked and how far rounding could move them (``snapkv.ranking_scores(cache)``; True: by
    ``snapkv.method.TIE_TOLERANCE`` relative, or a float: by that; a copy per layer, off by default).
    ``prefill_chunk``: a prefill runs each layer over chunks of this many tokens, holding the residual stream, one
    layer's keys and values and buffers of the chunk's size (``snapkv.prefill``); None: the model's own one-pass
    prefill. ``compress_sliding``: a model's sliding-window layers are compressed too, within their window (by
    default they hold what the model's own sliding cache holds, and only full-attention layers are compressed)."""
    session = CompressionSession(model, cfg, compress_later_turns, tokenizer, question_tokens, record_scores,
                                 prefill_chunk, compress_sliding)
    session.attach()
    try:
        yield session
    finally:
        session.detach()
