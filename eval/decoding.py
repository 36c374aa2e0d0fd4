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
    drafters: list | None = None              # speculative decoding: one drafter per row (eval.speculation)
    speculated: dict | None = None            # once decoded: its batch's passes, each row's drafted and accepted


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
        drafters = [d for k in batch for d in members[k].drafters] if members[batch[0]].drafters else None
        decoded = greedy_rows(model, cache, torch.cat(logits), len(batch), limits, mask,
                              weight_major=len(batch) > 1 or mask is not None, drafters=drafters)
        del logits, cache
        sync(device)
        seconds = time.perf_counter() - start
        per_member, first = [], 0
        for member in (members[k] for k in batch):
            rows = slice(first, first + member.rows)
            per_member.append(decoded.tokens[rows])
            member.speculated = {"passes": decoded.passes[rows], "speculative": drafters is not None,
                                 "drafted": decoded.drafted[rows], "accepted": decoded.accepted[rows]}
            member.after = decoding_cost(member.cache)
            member.cache = member.logits = member.drafters = None
            first += member.rows
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


@dataclass
class Decoded:
    """What ``greedy_rows`` wrote, per row: its tokens, the forward passes run while it was writing (a row's tokens
    less one, less the drafts it accepted), the drafts it verified and those it accepted (speculative decoding;
    zero otherwise)."""
    tokens: list[list[int]]
    passes: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def greedy_rows(model, cache, logits: torch.Tensor, groups: int, limits: Limits, mask: torch.Tensor | None = None,
                weight_major: bool = False, drafters: list | None = None) -> Decoded:
    """Greedy decoding of every row of a cache: ``groups`` consecutive groups of rows (the members of a merged
    cache, or one), each row stopping on its own. A member whose rows have all stopped leaves a merged cache
    (``snapkv.merge.drop_rows``: later steps compute the others only); a stopped row of an unfinished member runs on
    (its tokens are dropped). ``mask``: the 2-D padding mask of a left-padded batch (a plain cache attends through
    it, its rows at their own positions), extended at each step. ``weight_major``: the few-rows product of
    ``snapkv.merge.weight_major_linears`` (a batch of several members or prompts; a cache decoded alone keeps the
    model's own product, so its tokens are its solo run's).

    ``drafters`` (one per row, ``eval.speculation``): speculative decoding. Each pass carries the next token and
    every row's drafts (padded to the longest); each row accepts its drafts up to its first one greedy would not
    write, the batch the fewest any running row accepts, so every row writes greedy's tokens and the cache is cropped
    back by the same count for all (``CacheState.crop``)."""
    stop, total = limits.stop, logits.shape[0]
    rows = total // groups
    out = Decoded([[] for _ in range(total)], [0] * total, [0] * total, [0] * total)
    tokens = out.tokens
    done = [False] * total
    finished = [False] * groups
    alive = list(range(total))  # the original row of each row the cache holds now
    state = state_of(cache)
    merged = groups > 1 and state is not None and state.cfg is None
    step = 0  # tokens decided so far, every running row alike

    def barred(scores: torch.Tensor, at: int) -> torch.Tensor:
        if at < limits.min_new_tokens and stop:
            scores[..., list(stop)] = float("-inf")
        return scores

    def write(picks: list[int]) -> int:
        nonlocal step
        kept = 0
        for row, token in zip(alive, picks):
            if not done[row]:
                tokens[row].append(token)
                kept += 1
                done[row] = token in stop or step == limits.max_new_tokens - 1
        step += 1
        if limits.progress is not None:
            limits.progress(kept)
        return kept

    if limits.max_new_tokens < 1:
        return out
    speculation = snapkv.speculating(cache) if drafters else nullcontext()
    with weight_major_linears(model) if weight_major else nullcontext(), speculation:
        while True:
            picks = barred(logits, step).argmax(dim=-1)
            write(picks.tolist())
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
            drafts = drafted(drafters, alive, done, tokens, room(cache, limits.max_new_tokens - step), stop) \
                if drafters else []
            width = max((len(d) for d in drafts), default=0)
            feed = picks[:, None]
            if width:
                padded = [d + [int(p)] * (width - len(d)) for d, p in zip(drafts, picks.tolist())]
                feed = torch.cat([feed, torch.tensor(padded, device=picks.device)], dim=1)
            extra = {}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], width + 1)], dim=1)
                steps = torch.arange(-width, 1, device=mask.device)
                extra.update(attention_mask=mask, position_ids=mask.sum(dim=1, keepdim=True) - 1 + steps)
            scores = model(feed, cache=cache, use_cache=True, **extra).logits
            for row in alive:
                out.passes[row] += not done[row]
            take = 0
            if width:
                for j in range(width + 1):
                    barred(scores[:, j], step + j)
                greedy = scores.argmax(dim=-1).tolist()
                agreed = [agreeing(d, g) for d, g in zip(drafts, greedy)]
                take = min(a for a, row in zip(agreed, alive) if not done[row])
                for pos, row in enumerate(alive):
                    out.drafted[row] += len(drafts[pos]) if not done[row] else 0
                    out.accepted[row] += take if not done[row] else 0
                for j in range(take):
                    write([greedy[pos][j] for pos in range(len(alive))])
            if drafters:  # after every pass, as transformers crops: the cuts the accepted tokens made due run, and
                cache.crop(take - width)  # a sliding layer recording its past holds its window again
                if mask is not None and width > take:
                    mask = mask[:, :take - width]
            logits = scores[:, take]
            if all(done):
                break
    return out


def room(cache, left: int) -> int:
    """The most drafts one pass may verify: one less than the tokens left to write (the target writes the last one
    itself) and than a cut while decoding is away (``snapkv.tokens_before_cut``: the pass is the next token then its
    drafts)."""
    before_cut = snapkv.tokens_before_cut(cache)
    return max(0, min(left - 1, left if before_cut is None else before_cut - 1))


def drafted(drafters: list, alive: list[int], done: list[bool], tokens: list[list[int]], most: int, stop) -> list:
    """Each running row's drafts (a stopped row drafts nothing)."""
    if most < 1:
        return [[] for _ in alive]
    return [[] if done[row] else drafters[row].drafts(tokens[row], most, stop)[:most] for row in alive]


def agreeing(drafts: list[int], greedy: list[int]) -> int:
    """How many leading drafts equal what greedy writes after the ones before them."""
    count = 0
    for draft, token in zip(drafts, greedy):
        if draft != token:
            break
        count += 1
    return count
