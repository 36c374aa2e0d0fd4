"""FINCH (Corallo and Papotti, TACL 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language
Models", https://direct.mit.edu/tacl/article/doi/10.1162/tacl_a_00716/125280): SnapKV-like, with the question as
the observation window, and the kept keys re-rotated to contiguous positions.

As kvpress 0.5.5 ``FinchPress`` runs it (its registry entry ``finch``, on the query-aware board: chunk_length None,
normalize_scores True, rerotate_keys True): the window is the prompt's question (kvpress finds it from a delimiter
token between context and question, whose embedding it removes, so the model sees exactly context + question;
here the session is told the question's length, ``Method.needs_question_length``); the window queries' attention
over the earlier keys (scaled dot product, causal inside the window, softmax in float32 cast back), each query
row multiplied by the count of keys it sees (``normalize_scores``: ``k_len - window + i``), averaged over the
window and over each KV group's query heads (``gqa=mean``; ``max`` takes the largest); the window itself padded
with ``max + 1`` (always kept); the top ``n_kept = max(1, int(L (1 - ratio)))`` (or ``budget``) positions, or with
``chunk_length`` the top share of each chunk of the prompt; the kept positions sorted and their keys re-rotated
(``Method.rerotates_keys``): the cache is then a plain contiguous one of ``n_kept`` tokens and decoding continues
at position ``n_kept``, as kvpress's pipeline continues at ``cache.get_seq_length()``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import InputError, check_bool, check_choice, check_int
from ..memory import window_scores_bytes
from ..prompt_scores import WholePromptMethod
from ..registry import register
from ..select import attention_softmax, model_logits, outside_window

# the question length the memory planner assumes (the window's scores are computed a few KV heads at a time)
PLANNED_QUESTION_TOKENS = 256


@register
@dataclass
class Finch(WholePromptMethod):
    method = "finch"
    display_name = "FINCH"
    kvpress_entries = {"finch": {
        "placements": ("aware",),
        "parity": "kept positions and tokens equal (tested; the question's length given where kvpress finds a "
                  "delimiter token)"}}
    paper = "FINCH, TACL 2024 (doi 10.1162/tacl_a_00716)"
    reference = ("kvpress 0.5.5 `FinchPress` (the question as the window, scores normalised by the keys each query "
                 "sees, averaged per KV group; kept keys re-rotated to contiguous positions)")
    budget_meaning = ("tokens per KV head, the question included (`ratio`: kvpress's "
                      "`n_kept = max(1, int(n (1 - ratio)))`)")
    deviations = ("the question's length is given to the session (`question_tokens`) instead of a delimiter token in "
                  "the prompt; one prompt per prefill (no padded batch); with `chunk_length`, a ratio only")
    needs_question_length = True
    pads_batches = False           # one question length per prompt
    scores_while_decoding = False  # its window is the prompt's question
    untagged: ClassVar[tuple] = ()
    tag_parts: ClassVar[tuple] = ("{gqa}", "n{normalize_scores}", "c{chunk_length}", "rr{rerotate_keys}")
    normalize_scores: bool = True
    chunk_length: int | None = None
    rerotate_keys: bool = True

    def validate(self) -> None:
        self.window = 0
        self.check_budget_or_ratio()
        check_choice("gqa", self.gqa, ("mean", "max"))
        check_bool("normalize_scores", self.normalize_scores)
        check_bool("rerotate_keys", self.rerotate_keys)
        if self.chunk_length is not None:
            check_int("chunk_length", self.chunk_length, 1)
            if self.ratio is None:
                raise InputError(f"chunk_length={self.chunk_length}: chunks keep a share each; set ratio "
                                 "(budget=null), or chunk_length=null")

    @property
    def rerotates_keys(self) -> bool:
        return self.rerotate_keys

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        """``n_kept`` (the same for every layer), or with chunks the sum of each chunk's share."""
        if self.chunk_length is None:
            return self.budget_for(length)
        return sum(self.budget_for(min(self.chunk_length, length - start))
                   for start in range(0, length, self.chunk_length))

    def select(self, ctx, budget: int, window: int):
        question = ctx.question_tokens
        length = ctx.keys.shape[-2]
        if question is None or not 0 < question < length:
            raise InputError(f"{self.method}: question_tokens={question!r} must be in [1, {length - 1}] for a prompt "
                             f"of {length} tokens")
        scores = self.prompt_scores(ctx)
        if self.chunk_length is None:
            kept = scores.topk(budget, dim=-1).indices
        else:
            if self.chunk_length <= question / (1 - self.ratio):
                raise InputError(f"chunk_length={self.chunk_length} must be larger than the question's "
                                 f"{question} tokens / (1 - ratio) (kvpress's condition)")
            kept = torch.cat([start + scores[..., start:start + self.chunk_length].topk(
                self.budget_for(min(self.chunk_length, length - start)), dim=-1).indices
                for start in range(0, length, self.chunk_length)], dim=-1)
        return kept.sort(dim=-1).values, None

    def prefill_rows(self, length: int, question_tokens: int | None) -> int | None:
        return question_tokens  # the question's queries (None, not told: every row)

    def prompt_scores(self, ctx) -> torch.Tensor:
        """``[b, kv_heads, L]``: the question's (normalised) attention over the earlier positions, averaged over
        its queries and each KV group, the question itself above every other position (kvpress's ``max + 1``)."""
        question = ctx.question_tokens
        scores = ctx.shared(("finch_scores", question, self.normalize_scores, self.gqa),
                            lambda: self._scores(ctx, question))
        return F.pad(scores, (0, question), value=scores.max().item() + 1)

    def _scores(self, ctx, window: int) -> torch.Tensor:
        keys = ctx.keys
        b, n_kv, k_len, d = keys.shape
        queries = ctx.queries(window)  # [b, H, window, d], post-RoPE
        n_heads = queries.shape[1]
        group = n_heads // n_kv
        # kvpress divides by sqrt(head_dim); a module scaling otherwise is the module's (and its soft-capping,
        # sinks and sliding window: ``ctx.form``)
        form = ctx.form
        if form.scaling is not None and form.scaling == d ** -0.5:
            form = replace(form, scaling=None)
        sinks = None if form.sinks is None else form.sinks.view(1, n_heads, 1, 1)
        mask = torch.triu(torch.full((window, k_len), float("-inf"), dtype=queries.dtype, device=queries.device),
                          diagonal=k_len - window + 1)
        positions = torch.arange(k_len, device=queries.device)
        older = outside_window(positions[-window:], positions, form.sliding_window)
        if older is not None:
            mask = mask.masked_fill(older, float("-inf"))
        counts = torch.arange(k_len - window, k_len, device=queries.device)[None, None, :, None]
        per_head = []
        step = max(1, (256 * 2**20) // max(b * group * window * k_len * 4, 1))  # KV heads at a time
        for start in range(0, n_kv, step):
            heads = slice(start * group, min(n_kv, start + step) * group)
            repeated = keys[:, start:start + step, None].expand(-1, -1, group, -1, -1).reshape(b, -1, k_len, d)
            weights = model_logits(torch.matmul(queries[:, heads], repeated.transpose(2, 3)), d, form)
            weights = attention_softmax(weights + mask, None if sinks is None else sinks[:, heads]).to(queries.dtype)
            weights = weights[..., :-window]
            if self.normalize_scores:
                weights = weights * counts
            per_head.append(weights.mean(dim=-2))
        scores = torch.cat(per_head, dim=1).view(b, n_kv, group, k_len - window)
        return scores.mean(dim=2) if self.gqa == "mean" else scores.amax(dim=2)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The window's scores for a question of ``PLANNED_QUESTION_TOKENS`` (at most the prompt), as SnapKV's."""
        return window_scores_bytes(shape, min(length, PLANNED_QUESTION_TOKENS), length, batch, nbytes)
