"""Where a compressed cache needs transformers to behave otherwise than it does, in one place.

transformers assumes a cache holds every token it has seen, one KV head group per layer as the
attention module says, and that ``generate`` may reorder or crop it. A compressed cache holds fewer
tokens than it has consumed, possibly one KV head per query head (``gqa="repeat"``), and cannot be
reordered by beam search or cropped by assisted decoding. Each workaround below names what it
replaces; nothing else in ``snapkv`` touches transformers internals.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .architectures import CACHE_ARGUMENTS
from .errors import InputError


def cache_argument(kwargs: dict):
    """The cache a decoder or attention forward was called with (``past_key_values``; some modules
    name it ``cache``, GPT-NeoX's attention ``layer_past``), or None."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def report_consumed(cache, state) -> None:
    """``generate`` and the model read ``cache.get_seq_length()`` to place new tokens: make a
    compressed cache report the tokens it has consumed (``state.consumed``, the absolute position of
    the next one), not the kept ones."""
    cache.get_seq_length = lambda layer_idx=0: state.consumed


def filled_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A cache layer holding ``keys``/``values`` as they are (transformers' layers fill themselves
    through ``update``, which would concatenate)."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def filled_sliding_layer(keys: torch.Tensor, values: torch.Tensor, window: int, seen: int) -> DynamicSlidingWindowLayer:
    """A sliding-window layer as the model's own cache holds it after ``seen`` tokens whose last keys and values are
    ``keys``/``values``: the last ``window - 1`` of them, copied (a view would keep a longer buffer alive)."""
    layer = DynamicSlidingWindowLayer(sliding_window=window)
    layer.lazy_initialization(keys, values)
    held = min(window - 1, keys.shape[-2])
    layer.keys, layer.values = keys[:, :, -held:].clone(), values[:, :, -held:].clone()
    layer.cumulative_length = seen
    return layer


class RepeatedKVLayer(DynamicLayer):
    """A cache layer holding one KV head per query head (``gqa="repeat"``, the official layout): new
    tokens are repeated to every query head as they arrive, and the attention module must then use
    one KV group (``kv_groups_for``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, groups: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.groups = keys, values, groups

    def update(self, key_states, value_states, *args, **kwargs):
        key_states = key_states.repeat_interleave(self.groups, dim=1)
        value_states = value_states.repeat_interleave(self.groups, dim=1)
        return super().update(key_states, value_states, *args, **kwargs)


def kv_groups_for(layer, model_groups: int) -> int:
    """The ``num_key_value_groups`` an attention module must use with ``layer``: 1 for a layer that
    already holds a KV head per query head, else the model's own."""
    return 1 if isinstance(layer, RepeatedKVLayer) else model_groups


def check_cache(cache) -> None:
    """Only a DynamicCache (of full-attention layers and the model's sliding ones) can hold per-layer lengths."""
    plain = (DynamicLayer, DynamicSlidingWindowLayer, RepeatedKVLayer)
    ok = type(cache) is DynamicCache and not getattr(cache, "offloading", False) and all(
        type(layer) in plain or getattr(layer, "snapkv_layer", False) for layer in cache.layers)
    if not ok:
        raise InputError(f"cache={type(cache).__name__}: a compressed cache must be a DynamicCache (of full-attention "
                         "and the model's sliding-window layers), not static, offloaded or quantized (per-layer "
                         "lengths cannot live there)")


def rolls_back(cache, crop) -> None:
    """transformers rolls back rejected drafts (assisted and prompt-lookup decoding) with ``cache.crop(-n)``, which
    drops the last ``n`` slots of each layer: a compressed cache also rolls back its own positions and counts
    (``crop(cache, -n)``: ``CacheState.crop``), so the cache's ``crop`` is replaced. It holds the cache weakly: a
    cache referring to itself would stay in memory, its tensors with it, until the garbage collector next runs."""
    held = weakref.ref(cache)
    cache.crop = lambda tokens: crop(held(), tokens)


def checked_generate(model, generate, speculation_refused, speculating, room):
    """``generate`` with the decoding strategies a compressed cache cannot follow refused (it
    replaces ``model.generate`` while a compression session is attached); speculative decoding (an
    ``assistant_model`` or ``prompt_lookup_num_tokens``) runs as ``speculative_generate``, unless
    ``speculation_refused()`` gives the reason the session's settings cannot follow it (``speculating`` and
    ``room``: as ``speculative_generate`` takes them)."""
    def run(*args, **kwargs):
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def setting(name, default=None):
            return kwargs.get(name, getattr(config, name, default))
        if (setting("num_beams", 1) or 1) > 1:
            raise InputError("num_beams > 1: beam search reorders cache rows, which a compressed cache's per-row "
                             "positions do not follow; use greedy or sampling")
        if setting("prefill_chunk_size"):
            raise InputError("prefill_chunk_size: transformers' chunked prefill would be compressed after its first "
                             "chunk; leave it unset (snapkv.compress chunks each prefill itself: prefill_chunk=)")
        if kwargs.get("assistant_model") is not None or setting("prompt_lookup_num_tokens"):
            reason = speculation_refused()
            if reason:
                raise InputError(reason)
            return speculative_generate(model, generate, args, kwargs, setting, speculating, room)
        return generate(*args, **kwargs)
    return run


SPECULATION = ("assistant_model", "prompt_lookup_num_tokens")


def speculative_generate(model, generate, args, kwargs, setting, speculating, room):
    """Assisted or prompt-lookup decoding on a cache the session compresses: the first pass of transformers' own
    would carry the prompt and the first drafts together, and the drafts would be compressed as if they were the
    prompt. So the prompt is prefilled alone first (``generate`` of one token, the first token as plain decoding
    writes it), then the rest is speculated on that cache (inside ``speculating(cache)``), whose crops roll back the
    rejected drafts (``CacheState.crop``). ``room(cache)``: how many tokens a pass may carry before a cut while
    decoding falls inside it (None: no limit); the drafts are cut to one less. Greedy, it writes plain greedy's
    tokens."""
    inputs = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    if inputs is None or inputs.dim() != 2 or inputs.shape[0] != 1:
        raise InputError("input_ids: speculative decoding takes one prompt of token ids [1, length]")
    if setting("return_dict_in_generate"):
        raise InputError("return_dict_in_generate: speculative decoding on a compressed cache returns the sequences "
                         "only")
    new_tokens = setting("max_new_tokens")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise InputError(f"max_new_tokens={new_tokens!r}: give the number of new tokens for speculative decoding")
    at_least = setting("min_new_tokens") or 0
    rest = {name: value for name, value in kwargs.items() if name not in ("max_new_tokens", "min_new_tokens", "cache",
                                                                          "past_key_values", "max_length")}
    cache = kwargs.get("cache") or kwargs.get("past_key_values") or DynamicCache(config=model.config)
    plain = {name: value for name, value in rest.items() if name not in SPECULATION}
    if setting("prompt_lookup_num_tokens"):  # a generation config may carry it
        plain["prompt_lookup_num_tokens"] = None
    first = generate(inputs, cache=cache, max_new_tokens=1, min_new_tokens=min(at_least, 1), **plain)
    eos = setting("eos_token_id")
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    if new_tokens == 1 or (int(first[0, -1]) in eos and at_least <= 1):
        return first
    mask = rest.pop("attention_mask", None)
    if mask is not None:
        rest["attention_mask"] = torch.cat([mask, mask.new_ones(1, first.shape[1] - mask.shape[1])], dim=1)
    # transformers' assisted decoding treats its first pass as the prefill and feeds every token again, the cached
    # ones included: the session drops those from that pass (``repeated_prefix``)
    setattr(cache, REPEATED_PREFIX, cache.get_seq_length())
    try:
        with speculating(cache), capped_drafts(model, lambda: room(cache)):
            return generate(first, cache=cache, max_new_tokens=new_tokens - 1, min_new_tokens=max(at_least - 1, 0),
                            **rest)
    finally:
        setattr(cache, REPEATED_PREFIX, 0)


@contextmanager
def capped_drafts(model, room):
    """While it lasts, the drafts of transformers' candidate generators (assisted and prompt-lookup decoding) are cut
    to ``room() - 1`` tokens, so that a verification pass never crosses a cut while decoding (``room()`` None: as
    drafted). The assistant's own cache follows: it crops to the accepted tokens before it drafts again."""
    make = model._get_candidate_generator

    def making(*args, **kwargs):
        generator = make(*args, **kwargs)
        draft = generator.get_candidates

        def capped(input_ids, **more):
            candidates, logits = draft(input_ids, **more)
            most = room()
            if most is not None:
                keep = max(most - 1, 0)
                candidates = candidates[:, :input_ids.shape[1] + keep]
                logits = None if logits is None else logits[:, :keep]
            return candidates, logits
        generator.get_candidates = capped
        return generator
    model._get_candidate_generator = making
    try:
        yield
    finally:
        del model._get_candidate_generator  # the class's method is back


REPEATED_PREFIX = "_snapkv_repeated_prefix"


def repeated_prefix(cache, kwargs: dict) -> None:
    """A pass of transformers' assisted decoding on a cache that already holds the prompt (``speculative_generate``)
    feeds the cached tokens again first: they are dropped from ``kwargs`` (its ids and position ids), once."""
    cached = getattr(cache, REPEATED_PREFIX, 0)
    ids = kwargs.get("input_ids")
    if not cached or ids is None or ids.shape[1] <= cached:
        return
    setattr(cache, REPEATED_PREFIX, 0)
    kwargs["input_ids"] = ids[:, cached:]
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"][..., cached:]


RAGGED_ATTENTION = "snapkv_ragged"


def ragged_attention(module, query, key, value, attention_mask, snapkv_segments=None, **kwargs):
    """transformers' sdpa attention, run per group of rows on that group's own slots.

    Caches merged into one batch (``snapkv.merge_caches``) are left-padded to their longest member;
    masking the padding still reads it at every step, so a batch beside full KV would read full's
    length for every row. ``snapkv_segments`` ``[(first_row, end_row, first_slot), ...]`` gives each
    member's rows and where its real slots begin: each member then attends over its own slots only,
    the call a cache decoding alone makes (one new token, no mask). Rows no segment names belong to a
    member that has finished (``snapkv.merge.finish_member``): their output is zero. Without segments:
    plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if snapkv_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs, row = [], 0
    rows, heads, q_len, d = query.shape
    for a, b, start in snapkv_segments:
        if a > row:
            outputs.append(query.new_zeros(a - row, q_len, heads, d))
        outputs.append(sdpa_attention_forward(module, query[a:b], key[a:b, :, start:], value[a:b, :, start:], None,
                                              **kwargs)[0])
        row = b
    if row < rows:
        outputs.append(query.new_zeros(rows - row, q_len, heads, d))
    return torch.cat(outputs), None


def takes_ragged_attention(config) -> bool:
    """Whether a model with this config can attend per member (its attention is sdpa, or switched)."""
    return config._attn_implementation in ("sdpa", RAGGED_ATTENTION)


def route_attention(module, name: str) -> None:
    """Route ``module``'s attention through the function registered as ``name`` (``ragged_attention``,
    ``snapkv.ragged.headwise_attention``, or the model's own to switch back). transformers picks the
    attention function from the model config at each call, so the config's name is switched around the
    module's call."""
    from transformers import AttentionInterface

    from .ragged import HEADWISE_ATTENTION, headwise_attention
    for registered, function in ((RAGGED_ATTENTION, ragged_attention), (HEADWISE_ATTENTION, headwise_attention)):
        if registered not in AttentionInterface._global_mapping:
            AttentionInterface.register(registered, function)
    if module.config._attn_implementation != name:
        module.config._attn_implementation = name
