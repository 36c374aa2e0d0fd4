"""The one decode loop: every generation path of the runner (one prompt under one or several settings,
items in flight prefilled one by one or as a padded batch, the bench's repeated decodes) hands it its
caches, and it runs each batch alike: the question's pass where the question was kept out of the
compression, the merge of several caches into one batch, greedy decoding with each row stopping on its
own, and the batch's time. Decoding-time work (compression while the model writes) belongs here, once.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

import snapkv
from snapkv.cache_state import state_of
from snapkv.merge import drop_rows, weight_major_linears


@dataclass
class Member:
    """One cache to decode: ``rows`` rows of one setting (one prompt, or a left-padded batch of prompts)."""
    cache: object
    logits: torch.Tensor | None = None        # [rows, vocab]: the last prompt token's; None: ``question`` gives them
    question: Callable | None = None          # cache -> those logits, after appending the question to the cache
    rows: int = 1
    mask: torch.Tensor | None = None          # a left-padded batch's 2-D padding mask (it decodes alone)
    after: dict | None = None                 # a setting cutting while decoding: its cuts, their time, its last KV


@dataclass(frozen=True)
class Limits:
    """How long each row decodes: ``max_new_tokens``, the ids that stop it, and the tokens before a stop id
    may end it (``min_new_tokens``); ``progress(n)``, if given, after each step with the ``n`` tokens it kept (a
    progress bar by tokens for long answers, the bench's per-token times)."""
    max_new_tokens: int
    stop: frozenset = frozenset()
    min_new_tokens: int = 0
    progress: Callable[[int], None] | None = field(default=None, compare=False, hash=False)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode(model, members: list[Member], batches: list[list[int]], limits: Limits) -> Iterator[tuple]:
    """For each batch (indices into ``members``, one layout): ``(batch, tokens, seconds)``, ``tokens[k]`` the
    rows' tokens of the batch's k-th member and ``seconds`` the batch's (its question passes included).
    Several members are merged into one cache (``snapkv.merge_caches``, room for the answer); each member's
    cache is let go of once its batch is decoded."""
    device = next(model.parameters()).device
    for batch in batches:
        start = time.perf_counter()
        logits = [members[k].logits if members[k].question is None else members[k].question(members[k].cache)
                  for k in batch]
        if len(batch) == 1:
            cache, mask = members[batch[0]].cache, members[batch[0]].mask
        else:
            cache, mask = snapkv.merge_caches([members[k].cache for k in batch],
                                              spare_tokens=limits.max_new_tokens), None
        rows = greedy_rows(model, cache, torch.cat(logits), len(batch), limits, mask,
                           weight_major=len(batch) > 1 or mask is not None)
        del logits, cache
        sync(device)
        seconds = time.perf_counter() - start
        per_member = []
        for k, member in zip(batch, (members[k] for k in batch)):
            first = len(per_member) * member.rows
            per_member.append(rows[first:first + member.rows])
            member.after = decoding_cost(member.cache)
            members[k].cache = members[k].logits = None
        yield batch, per_member, seconds


def decoding_cost(cache) -> dict | None:
    """What a setting cutting its cache while decoding (``Method.decodes``) did, once it has decoded: the cuts
    (of every layer), their time, and the KV it holds at the end (read after ``sync``); None for another."""
    state = state_of(cache)
    if state is None or state.cfg is None or not state.cfg.decodes:
        return None
    held = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)
    return {"decode_cuts": state.decoding_cuts, "decode_cut_s": round(state.decoding_seconds.total(), 6),
            "final_kv_bytes": held}


def greedy_rows(model, cache, logits: torch.Tensor, groups: int, limits: Limits, mask: torch.Tensor | None = None,
                weight_major: bool = False) -> list[list[int]]:
    """Greedy decoding of every row of a cache: ``groups`` consecutive groups of rows (the members of a merged
    cache, or one), each row stopping on its own; the tokens of each row. A member whose rows have all stopped
    leaves a merged cache (``snapkv.merge.drop_rows``: later steps compute the others only); a stopped row of an
    unfinished member runs on (its tokens are dropped). ``mask``: the 2-D padding mask of a left-padded batch (a
    plain cache attends through it, its rows at their own positions), extended at each step. ``weight_major``:
    the few-rows product of ``snapkv.merge.weight_major_linears`` (a batch of several members or prompts; a
    cache decoded alone keeps the model's own product, so its tokens are its solo run's)."""
    stop, total = limits.stop, logits.shape[0]
    rows = total // groups
    tokens: list[list[int]] = [[] for _ in range(total)]
    done = [False] * total
    finished = [False] * groups
    alive = list(range(total))  # the original row of each row the cache holds now
    state = state_of(cache)
    merged = groups > 1 and state is not None and state.cfg is None
    with weight_major_linears(model) if weight_major else nullcontext():
        for step in range(limits.max_new_tokens):
            if step < limits.min_new_tokens and stop:
                logits[:, list(stop)] = float("-inf")
            picks = logits.argmax(dim=-1)
            kept = 0
            for row, token in zip(alive, picks.tolist()):
                if not done[row]:
                    tokens[row].append(token)
                    kept += 1
                    done[row] = token in stop or step == limits.max_new_tokens - 1
            if limits.progress is not None:
                limits.progress(kept)
            newly = [k for k in range(groups) if not finished[k] and all(done[k * rows:(k + 1) * rows])]
            for k in newly:
                finished[k] = True
            if all(done):
                break
            if newly and merged:
                staying = [pos for pos, row in enumerate(alive) if not finished[row // rows]]
                drop_rows(cache, [pos for pos, row in enumerate(alive) if finished[row // rows]])
                alive = [alive[pos] for pos in staying]
                picks = picks[staying]
            extra = {}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                extra.update(attention_mask=mask, position_ids=mask.sum(dim=1, keepdim=True) - 1)
            logits = model(picks[:, None], cache=cache, use_cache=True, **extra).logits[:, -1]
    return tokens
