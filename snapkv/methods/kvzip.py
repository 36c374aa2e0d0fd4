"""KVzip (Kim et al., arXiv 2505.23416, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"): a position matters as much as the model attends to it while repeating its context.

As kvpress 0.5.5 ``KVzipPress`` runs it, with its defaults (4 sinks, chunks of 2,048 context tokens,
budgets across layers, no KVzip+ normalization): after the prefill, the replay passes of
``snapkv.reconstruction`` score every (layer, KV head, position); the ``int(n_scores * ratio)`` lowest
over all layers are evicted, so layers and heads keep different counts (``layerwise=true``: the same
count per layer). The first prompt positions after the sinks that the chat template puts before the
user's text are never replayed and score 0, as in kvpress. Every layer's full KV stays until the replay
is done (the method needs it, as kvpress's does); then each layer stores only what its heads keep, each
head its own (``snapkv.ragged``; kvpress masks instead). The replay is shared by every KVzip ratio of a prefill.
Batch size 1; the tokenizer is the model's (``snapkv.compress(..., tokenizer=)``, or loaded from
``model.config.name_or_path`` as kvpress does).

The authors' code (snu-mllab/KVzip) differs from kvpress: it keeps the whole system prompt outside the
budget (``keep_prefix=true`` keeps the chat template's prefix), replays chunks of 2,000 tokens
(``chunk_size=2000``), its system prompt and answer frame are its own per model, its second request
ends in a space, its softmax sees the whole system prompt rather than 4 sinks, and its ``ratio`` is the
share kept (kvpress's ``compression_ratio`` the share removed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import check_bool, check_int
from ..head_budgets import pack
from ..registry import register
from ..prompt_scores import WholePromptMethod
from ..reconstruction import kept_in_layer, pruned_per_layer, reconstruction_scores

# its replay prompts the model, so it needs a tokenizer, which the tiny parity model has not
SMOLLM2_ONLY = "kept positions and tokens equal on SmolLM2 (tested; the replay needs a tokenizer)"


@register
@dataclass
class KVzip(WholePromptMethod):
    method = "kvzip"
    display_name = "KVzip"
    kvpress_entries = {"kvzip": {"parity": SMOLLM2_ONLY},
                       "kvzip_plus": {"plus_normalization": True, "option": "kvzip_plus", "parity": SMOLLM2_ONLY}}
    paper = "KVzip, arXiv 2505.23416"
    reference = "kvpress 0.5.5 `KVzipPress` with its defaults (4 sinks, chunks of 2,048, budgets across layers)"
    budget_meaning = "tokens per KV head on average over every layer and head"
    deviations = ("every layer stays whole until the replay ends (as in kvpress); batch size 1; stored per head, not "
                  "masked")
    tag_parts = ("s{n_sink}", "c{chunk_size}", "lw{layerwise}", "plus{plus_normalization}", "kp{keep_prefix}")
    head_adaptive = True
    scores_after_prefill = True
    pads_batches = False  # its replay repeats one prompt
    n_sink: int = 4
    chunk_size: int = 2048
    layerwise: bool = False
    plus_normalization: bool = False
    keep_prefix: bool = False

    def validate(self) -> None:
        super().validate()
        check_int("n_sink", self.n_sink, 0)
        check_int("chunk_size", self.chunk_size, 1)
        check_bool("layerwise", self.layerwise)
        check_bool("plus_normalization", self.plus_normalization)
        check_bool("keep_prefix", self.keep_prefix)

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        return length  # nothing is cut during the prefill: the replay needs every layer whole

    def stored_tokens(self, layer_idx: int, num_layers: int, length: int, heads: int) -> int:
        """The mean a head keeps (layers and heads differ: the split is only known after the replay)."""
        return min(length, self.budget_for(length))

    def replay_key(self) -> tuple:
        return ("kvzip", self.n_sink, self.chunk_size, self.plus_normalization, self.keep_prefix)

    def scores(self, replay, full: list, context_ids: torch.Tensor) -> torch.Tensor:
        return reconstruction_scores(replay.model, replay.layers, replay.decoder, full, context_ids,
                                     replay.tokenizer, self.n_sink, self.chunk_size,
                                     self.plus_normalization, self.keep_prefix)

    def keep_per_layer(self, scores: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, ``[b, kv_heads, L]`` bool: what each head keeps."""
        n_layers, b, heads, length = scores.shape
        if self.ratio is not None:
            per_layer = int(b * heads * length * self.ratio)
            total = int(scores.numel() * self.ratio)
        else:
            per_layer = b * heads * (length - min(self.budget, length))
            total = per_layer * n_layers
        counts = pruned_per_layer(scores, total, per_layer if self.layerwise else None)
        return [kept_in_layer(scores[i], n) for i, n in enumerate(counts)]

    def cut(self, scores: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(kept, valid)``, as ``Method.select`` returns them."""
        return [pack(keep) for keep in self.keep_per_layer(scores)]

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # its replay after the prefill

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """The scores of every layer, one replay layer's copy of K and V with the chunk's tokens, and the
        chunk's attention (every query head x its request x the sinks, chunk and request)."""
        chunk = min(length, self.chunk_size)
        request = chunk + 64
        scores = shape.layers * batch * shape.kv_heads * length * nbytes
        replay_kv = 2 * batch * shape.kv_heads * (length + request) * shape.head_dim * nbytes
        attention = batch * shape.heads * request * (self.n_sink + chunk + request) * 4 * 2
        return scores + replay_kv + attention
