"""What the methods wrapping another method's scores share, as kvpress composes presses (``AdaKVPress(press)``,
``CriticalKVPress(press)``, ``ChunkKVPress(press)``, ``BlockPress(press)``): the wrapped method as a field
(``scorer``: any registered method with ``scores_positions``, settable from Hydra), built with the wrapper's
budget or ratio, window, kernel, pooling and GQA reduction; and layer contexts narrowed to one batch row or to
a subset of positions, so the wrapped method scores them as it scores a whole prompt alone."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from .errors import InputError, check_choice, check_int, check_number
from .method import POOLINGS, Method
from .select import pack
from .registry import METHODS, build_config, scoring_methods


class ScorerWrapper:
    """The wrapped method's fields (``scorer``, ``scorer_epsilon`` and the SnapKV-family fields it is built
    with), their checks, and ``scorer_config``."""

    def check_scorer_fields(self) -> None:
        check_int("window", self.window, 1)
        self.check_budget_or_ratio()
        check_choice("gqa", self.gqa, ("mean", "max"))
        check_choice("scorer", self.scorer, scoring_methods())
        check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InputError(f"kernel={self.kernel} must be odd (pooling keeps the length with padding kernel // 2)")
        check_choice("pooling", self.pooling, POOLINGS)
        self.scorer_epsilon = check_number("scorer_epsilon", self.scorer_epsilon, 0)
        if self.scorer_epsilon and not self._scorer_has_epsilon():
            raise InputError(f"scorer_epsilon={self.scorer_epsilon:g}: scorer={self.scorer} has no epsilon; leave it 0")

    def _scorer_has_epsilon(self) -> bool:
        return "epsilon" in {f.name for f in fields(METHODS[self.scorer])}

    def prefill_rows(self, length: int, question_tokens: int | None) -> int | None:
        """The wrapped method's rows (``Method.prefill_rows``)."""
        return self.scorer_config().prefill_rows(length, question_tokens)

    def scorer_config(self) -> Method:
        """The wrapped method, with this one's budget or ratio, window, kernel, pooling and GQA reduction (and
        ``scorer_epsilon`` as its ``epsilon`` where it has one), as kvpress composes presses (the wrapper's
        compression ratio is its press's: Compactor blends by it)."""
        extra = {"epsilon": self.scorer_epsilon} if self._scorer_has_epsilon() else {}
        return build_config(self.scorer, budget=self.budget, ratio=self.ratio, window=self.window, kernel=self.kernel,
                            pooling=self.pooling, gqa=self.gqa, **extra)


@dataclass
class WrapperMethod(ScorerWrapper, Method):
    """A uniform method over another's scores, with kvpress's SnapKVPress defaults for the wrapped method
    (window 64, kernel 5, average pooling, the mean over each KV group); each file gives its ``scorer``. As in
    kvpress, nothing is kept unconditionally (the scorer's window neither), and a prompt not longer than the
    scorer's window is kept whole (kvpress refuses it)."""

    budget: int | None = 1024
    window: int = 64              # the scorer's (kvpress's SnapKVPress defaults)
    kernel: int = 5
    pooling: str = "avgpool"
    gqa: str = "mean"
    scorer: str = ""              # the wrapped method (each wrapper's file gives its default)
    scorer_epsilon: float = 0.0   # the scorer's epsilon, where it has one

    def validate(self) -> None:
        self.check_scorer_fields()
        if self.ratio is None and self.budget <= self.window:
            raise InputError(f"budget={self.budget} must be larger than window={self.window}")

    def budget_for(self, length: int) -> int:
        """``budget``, or kvpress's ``compute_n_kept`` (at least 1)."""
        return self.budget if self.ratio is None else max(1, int(length * (1 - self.ratio)))

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        """None: no position is kept unconditionally (not even the scorer's window, as in kvpress)."""
        return 0

    def scorer_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        """The scorer's window (KeyDiff: none): its queries must be in the prompt, and a prompt not longer is
        kept whole (kvpress's SnapKV refuses it)."""
        return self.scorer_config().recent_window(layer_idx, num_layers, length)

    def check_turn(self, ctx) -> None:
        """A later turn (``compress_later_turns``) shorter than the scorer's window cannot be scored."""
        turn, length = ctx.pass_tokens, ctx.keys.shape[-2]
        window = self.scorer_window(ctx.layer_idx, ctx.num_layers, length)
        if turn < length and turn <= window:
            raise InputError(f"{self.method}: a later turn of {turn} tokens is not longer than the scorer's "
                             f"window={window}; it cannot be compressed (compress_later_turns=False appends it as "
                             "it is)")

    def row_keep(self, ctx) -> torch.Tensor:
        """``[1, kv_heads, L]`` bool: what one batch row (``ctx`` narrowed to its real tokens) keeps."""
        raise NotImplementedError

    def select(self, ctx, budget: int, window: int):
        """Each row's kept positions from ``row_keep`` on that row alone (uniform where every row keeps as many,
        else each row its own count)."""
        self.check_turn(ctx)
        keep = torch.zeros(ctx.keys.shape[:3], dtype=torch.bool, device=ctx.keys.device)
        for row, pad, row_ctx in row_contexts(ctx):
            keep[row:row + 1, :, pad:] = self.row_keep(row_ctx)
        kept, valid = pack(keep)
        return kept, (None if bool(valid.all()) else valid)


def narrowed(ctx, **changes):
    """``ctx`` with ``changes`` (other keys, values, hidden states...) and nothing computed for the whole layer
    carried over: no shared score, no query projection or attention weights of the module's own call."""
    reset = {"memo": {}, "spans": {}, "reads": set(), "kept_queries": None}
    names = {f.name for f in fields(ctx)}
    if "weights" in names:
        reset["weights"] = None
    if "pass_tokens" in names and "hidden_states" in changes and "pass_tokens" not in changes:
        reset["pass_tokens"] = 0  # as many as the new hidden states
    return replace(ctx, **reset, **changes)


def rounding_spread(ctx, score, draws: int = 3, factor: float = 4.0) -> torch.Tensor:
    """``[b, heads, 1]``: how far rounding moves ``score(ctx)`` per head, measured: ``factor`` times the largest change
    over ``draws`` rescorings of ``ctx`` with its hidden states, keys and values each multiplied by ``1 + eps * N(0,
    1)`` (``eps`` of their dtype: about one rounding; a seeded generator, so the same every run). For a method whose
    scores pass through ill-conditioned steps (a solve, z-scores), where a relative tolerance says little."""
    noise = torch.finfo(ctx.keys.dtype).eps
    base = score(ctx)
    generator = torch.Generator().manual_seed(ctx.layer_idx)
    largest = torch.zeros_like(base)

    def jittered(tensor):
        jitter = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.device, tensor.dtype)
        return tensor * (1 + noise * jitter)
    for _ in range(draws):
        moved = score(narrowed(ctx, hidden_states=jittered(ctx.hidden_states), keys=jittered(ctx.keys),
                               values=jittered(ctx.values)))
        largest = torch.maximum(largest, (moved - base).abs())
    return factor * largest.amax(dim=-1, keepdim=True)


def row_contexts(ctx) -> list:
    """``(row, pad, context)`` per batch row: the row's own layer context on its real tokens (what the row
    alone gives the scorer: a score shared by a whole batch, such as SnapKV's window above every other
    position by the batch's largest score, would differ); one row without padding: ``ctx`` itself."""
    batch = ctx.keys.shape[0]
    if batch == 1 and ctx.pad_mask is None:
        return [(0, 0, ctx)]
    length = ctx.keys.shape[-2]
    if ctx.pass_tokens != length:
        raise InputError("a later turn of a batch cannot be compressed row by row (compress_later_turns=False "
                         "appends it as it is)")
    pads = [0] * batch if ctx.pad_mask is None else (~ctx.pad_mask).sum(dim=1).tolist()
    held = ctx.hidden_states.shape[1]  # the last rows of the prompt (a chunked prefill's last chunk)
    out = []
    for row, pad in enumerate(pads):
        def cut(tensor, row=row, first=max(0, pad - (length - held))):  # the row's real positions among them
            return (tensor[row:row + 1] if tensor.shape[0] > 1 else tensor)[:, first:]
        cos, sin = ctx.position_embeddings
        out.append((row, pad, narrowed(ctx, hidden_states=cut(ctx.hidden_states), pass_tokens=length - pad,
                                       position_embeddings=(cut(cos), cut(sin)), keys=ctx.keys[row:row + 1, :, pad:],
                                       values=ctx.values[row:row + 1, :, pad:], pad_mask=None)))
    return out
