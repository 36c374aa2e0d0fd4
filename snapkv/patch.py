"""The transformers integration: compress each layer's cache right after its prefill attention.

Forward hooks on every attention module replace that layer's freshly written full-length KV by
the kept positions before the next layer runs, so the full KV of all layers never coexists. The
prefill's own attention still saw the full KV (as in the official code); only what is stored is
compressed. A pre-hook on the decoder keeps decoding consistent with the shorter cache: absolute
position ids (the first generated token sits at the prompt length) and an attention mask of the
compressed length (padded positions kept only where a row is shorter than the budget).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from .architectures import check_supported, decoder_layers, window_queries
from .config import CompressorConfig
from .select import top_positions


def _cache_of(kwargs):
    return kwargs.get("cache", kwargs.get("past_key_values"))


class RepeatedKVLayer(DynamicLayer):
    """A cache layer holding one KV head per query head (``gqa="repeat"``, the official layout)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, groups: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.groups = keys, values, groups

    def update(self, key_states, value_states, *args, **kwargs):
        key_states = key_states.repeat_interleave(self.groups, dim=1)
        value_states = value_states.repeat_interleave(self.groups, dim=1)
        return super().update(key_states, value_states, *args, **kwargs)


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

    def queries(self, n: int) -> torch.Tensor:
        return window_queries(self.attn, self.hidden_states, self.position_embeddings, n)


@dataclass
class PrefillState:
    pad_mask: torch.Tensor | None
    next_positions: torch.Tensor
    in_prefill: bool = True
    cache_lengths: dict = field(default_factory=dict)
    kept_mask: torch.Tensor | None = None
    compressed: bool = False


class CompressionSession:
    """Hooks that apply one compressor config to one model; ``compress()`` attaches and detaches it."""

    def __init__(self, model, cfg: CompressorConfig):
        if not isinstance(cfg, CompressorConfig):
            raise ValueError(f"cfg={type(cfg).__name__} is not a compressor config (SnapKVConfig, H2OConfig, ...)")
        check_supported(model)
        limit = getattr(model.config, "max_position_embeddings", None)
        if cfg.compresses and limit and cfg.budget > limit:
            raise ValueError(f"budget={cfg.budget} is larger than the model's context "
                             f"(max_position_embeddings={limit})")
        self.model, self.cfg = model, cfg
        self.layers = decoder_layers(model)
        self.state: PrefillState | None = None
        self._handles: list = []
        self._groups = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> None:
        base = getattr(self.model, "base_model", self.model)
        self._handles.append(base.register_forward_pre_hook(self._before_decoder, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after_decoder))
        for layer in self.layers:
            attn = layer.self_attn
            self._groups[attn] = attn.num_key_value_groups
            self._handles.append(attn.register_forward_pre_hook(self._before_attention, with_kwargs=True))
            self._handles.append(attn.register_forward_hook(self._after_attention, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for attn, groups in self._groups.items():
            attn.num_key_value_groups = groups

    @property
    def cache_lengths(self) -> list[int]:
        """Tokens per head each layer kept at the last prefill."""
        if self.state is None:
            return []
        return [self.state.cache_lengths[i] for i in sorted(self.state.cache_lengths)]

    # -- decoder-level hooks ----------------------------------------------------------------
    def _before_decoder(self, module, args, kwargs):
        cache = _cache_of(kwargs)
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        q_len = tokens.shape[1]
        if cache is None or cache.get_seq_length() == 0:
            self.state = self._start_prefill(kwargs, q_len, tokens)
            return None
        state = self.state
        if state is None or not state.compressed:
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.ndim != 2:
            raise ValueError("attention_mask: a 4-D mask cannot follow a compressed cache; pass the 2-D padding mask")
        if kwargs.get("position_ids") is None:
            steps = torch.arange(q_len, device=state.next_positions.device)
            kwargs["position_ids"] = state.next_positions[:, None] + steps[None, :]
        state.next_positions = state.next_positions + q_len
        if state.kept_mask is None:
            # No padding was kept: causal masking alone is right for every layer, whatever its length.
            kwargs["attention_mask"] = None
        else:
            ones = torch.ones(state.kept_mask.shape[0], q_len, dtype=torch.bool, device=state.kept_mask.device)
            state.kept_mask = torch.cat([state.kept_mask, ones], dim=1)
            kwargs["attention_mask"] = state.kept_mask
        return args, kwargs

    def _start_prefill(self, kwargs, q_len: int, tokens) -> PrefillState:
        mask = kwargs.get("attention_mask")
        pad_mask = None
        if mask is not None:
            if mask.ndim != 2:
                raise ValueError("attention_mask: pass the 2-D padding mask [batch, length], not a 4-D mask")
            if not bool(mask.all()):
                pad_mask = mask.bool()
                n_layers = len(self.layers)
                if self.cfg.compresses and len({min(q_len, self.cfg.layer_budget(i, n_layers, q_len))
                                                 for i in range(n_layers)}) > 1:
                    raise ValueError(f"{self.cfg.method}: per-layer budgets need a batch without padding "
                                     "(attention_mask has zeros); run batch size 1")
        positions = kwargs.get("position_ids")
        if positions is not None:
            next_positions = positions[:, -1] + 1
        else:
            next_positions = torch.full((1,), q_len, dtype=torch.long)
        next_positions = next_positions.to(tokens.device).expand(tokens.shape[0]).clone()
        return PrefillState(pad_mask=pad_mask, next_positions=next_positions)

    def _after_decoder(self, module, args, output):
        if self.state is not None:
            self.state.in_prefill = False

    # -- attention-level hooks --------------------------------------------------------------
    def _before_attention(self, module, args, kwargs):
        cache = _cache_of(kwargs)
        if cache is None or module.layer_idx >= len(cache.layers):
            return None
        repeated = isinstance(cache.layers[module.layer_idx], RepeatedKVLayer)
        module.num_key_value_groups = 1 if repeated else self._groups[module]
        return None

    def _after_attention(self, module, args, kwargs, output):
        state = self.state
        if state is None or not state.in_prefill:
            return None
        cache = _cache_of(kwargs)
        idx = module.layer_idx
        if cache is None:
            return None
        layer = cache.layers[idx]
        keys, values = layer.keys, layer.values
        length = keys.shape[-2]
        n_layers = len(self.layers)
        cfg = self.cfg
        budget = cfg.layer_budget(idx, n_layers, length) if cfg.compresses else length
        if length <= budget:
            state.cache_lengths[idx] = length
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        ctx = LayerContext(module, hidden, kwargs["position_embeddings"], keys, values, state.pad_mask,
                           idx, n_layers)
        window = cfg.recent_window(idx, n_layers)
        with torch.no_grad():
            scores = cfg.score(ctx)
            kept = top_positions(scores, budget - window, state.pad_mask)
            recent = torch.arange(length - window, length, device=keys.device)
            kept = torch.cat([kept, recent.expand(*kept.shape[:2], window)], dim=-1)
            groups = self._groups[module]
            if kept.shape[1] != keys.shape[1]:  # gqa="repeat": one selection per query head
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            gather = kept[..., None].expand(-1, -1, -1, keys.shape[-1])
            new_keys, new_values = keys.gather(2, gather), values.gather(2, gather)
        if kept.shape[1] != layer.keys.shape[1]:
            cache.layers[idx] = RepeatedKVLayer(new_keys, new_values, groups)
        else:
            layer.keys, layer.values = new_keys, new_values
        self._record_kept_mask(state, kept)
        state.cache_lengths[idx] = budget
        state.compressed = True
        return None

    def _record_kept_mask(self, state: PrefillState, kept: torch.Tensor) -> None:
        """Remember which kept slots are padding (left-padded rows shorter than the budget)."""
        if state.pad_mask is None:
            return
        mask = state.pad_mask.gather(1, kept[:, 0])
        if state.kept_mask is not None and not torch.equal(state.kept_mask, mask):
            raise ValueError(f"{self.cfg.method}: layers kept different padding; run batch size 1")
        state.kept_mask = mask


@contextmanager
def compress(model, cfg: CompressorConfig):
    """Inside the context every prefill leaves each layer's cache compressed by ``cfg``."""
    session = CompressionSession(model, cfg)
    session.attach()
    try:
        yield session
    finally:
        session.detach()
