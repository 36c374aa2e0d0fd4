"""What the methods that score every prompt position share (kvpress's ``ScorerPress`` family: Knorm,
KeyDiff, Expected Attention; AdaKV's scorers): no recent window of their own, a left-padded batch
scored row by row on each row's real tokens, and positions a method always keeps given a score above
every other (kvpress pads them with ``max + 1``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .errors import check_choice
from .method import GQA_MODES, Method
from .select import always_kept  # noqa: F401  (part of what the scorers share)


@dataclass
class WholePromptMethod(Method):
    """A method whose ``score`` ranks all ``L`` prompt positions (``window`` is 0): a prompt of ``n``
    tokens keeps ``budget``, or ``max(1, int(n * (1 - ratio)))`` (kvpress's ``compute_n_kept``). Scores
    are per KV head, so ``gqa`` changes nothing (``repeat``, a selection per query head, is refused)."""

    budget: int | None = 1024
    window: int = 0  # derived
    derived: ClassVar[tuple] = ("window",)
    untagged: ClassVar[tuple] = ("gqa",)
    tag_parts: ClassVar[tuple] = ()

    def validate(self) -> None:
        self.window = 0
        self.check_budget_or_ratio()
        check_choice("gqa", self.gqa, tuple(mode for mode in GQA_MODES if mode != "repeat"))


def by_real_rows(pad_mask: torch.Tensor | None, score_rows, fill=float("-inf")) -> torch.Tensor:
    """``score_rows(rows, first)`` -> ``[rows, heads, L - first]``: scores (or a kept mask) of the batch
    rows ``rows`` (a slice) from position ``first`` on. Without padding, the whole batch at once; with
    left padding, each row on its own real tokens (what it gets unbatched), its padded positions
    ``fill``."""
    if pad_mask is None:
        return score_rows(slice(None), 0)
    parts = []
    for row, pad in enumerate((~pad_mask).sum(dim=1).tolist()):
        part = score_rows(slice(row, row + 1), pad)
        parts.append(F.pad(part, (pad, 0), value=fill))
    return torch.cat(parts)
