"""Comparing what we keep with what a reference kept on another machine, exact where the decision is clear.

A reference's fixture (kvpress's cases, written by kvpress itself) was written on one CPU; float32 kernels round
differently on another, and where two positions' scores are equal to the last bits (layer 0, where the same token's
keys have the same norm; LagKV's ranks, equal across partitions) ``topk`` may keep the other one. A (layer, head)
pair that differs passes as a **tie** only when it keeps as many positions as the reference and the cut (the lowest
score it kept, as we compute it) lies within the bounds of every position kept by one side alone (a head-adaptive
cut: the same over all the layer's heads at once, which may trade positions): how far
another machine's rounding could move that position's score, ``snapkv.method.TIE_TOLERANCE`` (1e-5) relative
(``snapkv.ranking_scores``, ``Method.ranking_bounds``). Any other difference fails, as does any difference of a
method whose cut ranks no per-head scores. Ties are counted (``TIES``) and reported at the end of the run
(``conftest.py``). The official SnapKV's selection and KVCache-Factory's schedules are compared in-process, on the
same machine's arithmetic (``tests/test_select.py``, ``tests/test_methods.py``), so they need no tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Comparison:
    pairs: int
    exact: int = 0
    ties: list = field(default_factory=list)      # (layer, head) passed within the tolerance
    differing: list = field(default_factory=list)  # (layer, head, why) that fail

    @property
    def equal(self) -> bool:
        return not self.differing

    def add(self, layer: int, head: int, why: str | None) -> None:
        """A differing pair: a tie when ``why`` is None."""
        if why is None:
            self.ties.append((layer, head))
        else:
            self.differing.append((layer, head, why))

    def reported(self, label: str) -> "Comparison":
        """Counts this comparison's ties under ``label`` (printed at the end of the run)."""
        if self.ties:
            TIES.setdefault(label, []).extend(self.ties)
        return self

    def describe(self, label: str) -> str:
        shown = "; ".join(f"layer {layer} head {head}: {why}" for layer, head, why in self.differing[:3])
        return (f"{label}: {len(self.differing)} of {self.pairs} (layer, head) pairs differ beyond a tie "
                f"({len(self.ties)} at a tie): {shown}")


# label -> (layer, head) pairs that passed as ties in this run (printed by conftest.pytest_terminal_summary)
TIES: dict[str, list] = {}


def tie_reason(got: np.ndarray, want: np.ndarray, ranked: tuple | None) -> str | None:
    """None when one (layer, head)'s kept positions ``got`` (bool over prompt positions) differ from ``want`` only
    by a tie at the cut; else why not. ``ranked``: that head's ``(scores, low, high)`` over the same positions."""
    if ranked is None:
        return "the method's cut ranks no per-head scores (an exact comparison)"
    if int(got.sum()) != int(want.sum()):
        return f"keeps {int(got.sum())} positions, the reference {int(want.sum())}"
    scores, low, high = ranked
    cut = float(scores[got].min())
    moved = np.flatnonzero(got != want)
    far = [int(p) for p in moved if not low[p] <= cut <= high[p]]
    if far:
        shown = ", ".join(f"{p}: {float(scores[p])!r} in [{float(low[p])!r}, {float(high[p])!r}]" for p in far[:4])
        return f"the cut {cut!r} is outside what rounding could move positions {far[:4]} to ({shown})"
    return None


def compare_kept(got: np.ndarray, want: np.ndarray, ranked: list | None = None, label: str = "") -> Comparison:
    """``got``/``want``: ``[layers, heads, positions]`` bool (the first batch row); ``ranked``: per layer what
    ``snapkv.ranking_scores`` gives (``RankedScores`` of ``[rows, heads, positions]`` tensors, or None). A cut over
    all a layer's heads at once (``across_heads``) is one decision: its heads may trade positions at a tie."""
    layers, heads, length = want.shape
    result = Comparison(pairs=layers * heads)
    for layer in range(layers):
        here = None if ranked is None else ranked[layer]
        differ = [head for head in range(heads) if not (got[layer, head] == want[layer, head]).all()]
        result.exact += heads - len(differ)
        if not differ:
            continue
        if here is not None and here.across_heads:  # the layer's heads as one row of positions
            parts = tuple(part[0, :, :length].reshape(-1).numpy() for part in here[:3])
            why = tie_reason(got[layer].reshape(-1), want[layer].reshape(-1), parts)
            reasons = {head: why for head in differ}
        else:
            reasons = {}
            for head in differ:
                head_ranked = None
                if here is not None and head < here.scores.shape[1]:
                    head_ranked = tuple(part[0, head, :length].numpy() for part in here[:3])
                reasons[head] = tie_reason(got[layer, head], want[layer, head], head_ranked)
        for head, why in reasons.items():
            result.add(layer, head, why)
    return result.reported(label)


def tied_at_a_cut(position: int, head: int, cuts: list, dropped: bool) -> bool:
    """Whether ``position`` was at a tie at a cut while decoding (``snapkv.decoding_rankings``): among that cut's
    slots for ``head``, with the cut's score within what rounding could move its score to. One we ``dropped`` must
    have been at a tie at the cut that dropped it (the last that saw it); one we hold, at one of the cuts that saw
    it (the reference dropped it at one of them)."""
    seen = []
    for cut in cuts:
        slots = np.flatnonzero(cut.positions[0, head].numpy() == position)
        if len(slots):
            seen.append((cut, slots[0]))
    if dropped:
        seen = seen[-1:]
    for cut, slot in seen:
        boundary = float(cut.scores[0, head][cut.kept[0, head]].min())
        if float(cut.low[0, head, slot]) <= boundary <= float(cut.high[0, head, slot]):
            return True
    return False


def compare_held(got: np.ndarray, want: np.ndarray, cuts: list, label: str = "") -> Comparison:
    """After compression while decoding: ``got``/``want`` ``[layers, heads, positions]`` bool, what each (layer,
    head) holds at the end; ``cuts``: ``snapkv.decoding_rankings`` of our cache. A pair that differs passes as a
    tie when it holds as many positions and every position held by one side alone was at a tie at our cut that
    dropped it, or (one we hold) at one of our cuts that saw it: a swap there decides what the later cuts see, so
    the difference is the tie's, not a bug's (``tied_at_a_cut``)."""
    layers, heads, _ = want.shape
    result = Comparison(pairs=layers * heads)
    for layer in range(layers):
        for head in range(heads):
            if (got[layer, head] == want[layer, head]).all():
                result.exact += 1
                continue
            if int(got[layer, head].sum()) != int(want[layer, head].sum()):
                why = f"holds {int(got[layer, head].sum())} positions, the reference {int(want[layer, head].sum())}"
            else:
                moved = np.flatnonzero(got[layer, head] != want[layer, head])
                far = [int(p) for p in moved
                       if not tied_at_a_cut(int(p), head, cuts[layer], dropped=not got[layer, head, p])]
                why = f"positions {far[:4]} were at no tie of our {len(cuts[layer])} cuts" if far else None
            result.add(layer, head, why)
    return result.reported(label)


def kept_array(cache, length: int, row: int = 0) -> np.ndarray:
    """``[layers, heads, length]`` bool: the prompt positions each head of ``row`` keeps (``snapkv.kept_positions``)."""
    import snapkv
    rows = snapkv.kept_positions(cache)
    kept = np.zeros((len(rows), len(rows[0][row]), length), dtype=bool)
    for layer, per_row in enumerate(rows):
        for head, positions in enumerate(per_row[row]):
            kept[layer, head, positions.numpy()] = True
    return kept
