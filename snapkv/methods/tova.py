"""TOVA (Oren et al., arXiv 2401.06104, "Transformers are Multi-State RNNs"), applied once at prefill:
the prompt's last token's attention ranks the earlier positions.

As kvpress 0.5.5 ``TOVAPress`` scores it: the last query's softmax attention over the earlier keys,
averaged over every query head of the layer (``average="all_heads"``: all KV heads keep the same
positions), and the last token is always kept (kvpress pads it with the maximum; TOVA's own cache does
not force it). ``average="kv_group"`` averages each KV group's query heads instead, one selection per
KV head. The original evicts one token per decoding step; this variant compresses the prompt once.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..memory import window_scores_bytes
from ..errors import InputError, check_choice
from ..observation_window import window_votes
from ..prompt_scores import WholePromptMethod
from ..registry import register
from ..select import aggregate_heads

AVERAGES = ("all_heads", "kv_group")


@register
@dataclass
class TOVA(WholePromptMethod):
    method = "tova"
    display_name = "TOVA"
    kvpress_entries = {"tova": {}}
    paper = "TOVA, arXiv 2401.06104"
    reference = ("kvpress 0.5.5 `TOVAPress` (the last query's attention averaged over every query head; the last "
                 "token kept)")
    budget_meaning = "tokens per head, the last token included"
    deviations = ("one-shot at prefill (TOVA evicts while decoding); `average=kv_group` averages per KV group instead"
                  " of over all heads")
    scores_positions = True
    tag_parts = ("{average}",)
    window: int = 1  # derived: the last token
    average: str = "all_heads"

    def validate(self) -> None:
        check_choice("average", self.average, AVERAGES)
        self.window = 1
        self.check_budget_or_ratio()
        if self.ratio is None and self.budget < 2:
            raise InputError(f"budget={self.budget} must be at least 2 (the last token and one more)")

    def budget_for(self, length: int) -> int:
        """kvpress's ``compute_n_kept`` (at least 1: then only the last token)."""
        if self.ratio is None:
            return self.budget
        return max(int(length * (1 - self.ratio)), 1)

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        return 1

    def score(self, ctx):
        _, attention = window_votes(ctx, 1)  # [b, H, L - 1]: the last query's attention
        n_kv = ctx.keys.shape[1]
        if self.average == "kv_group":
            return aggregate_heads(attention, n_kv, "mean")
        b, _, n = attention.shape
        return attention.mean(dim=1, keepdim=True).expand(b, n_kv, n)

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 1  # the last query's attention

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        return window_scores_bytes(shape, 1, length, batch, nbytes)
