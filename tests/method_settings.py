"""Every registered method at a test size: the list that drives the generic tests. A method added
to ``snapkv/methods/`` (its file and one import line) is covered by them without touching a test."""
from __future__ import annotations

import snapkv

REGISTERED = sorted(snapkv.METHODS)
COMPRESSING = [name for name in REGISTERED if snapkv.METHODS[name]().compresses]


def _needs_input(name: str) -> bool:
    """Whether a setting of the method built from its defaults cannot run on a prompt alone."""
    cls = snapkv.METHODS[name]
    return cls.needs_local_data or cls.needs_question_length


# the compressing methods that run from their defaults (``Method.needs_local_data``: DuoAttention reads a local
# pattern folder or texts; ``Method.needs_question_length``: FINCH is told the question's length at each prefill;
# their own tests give them): the generic tests that run a model take these
RUNNABLE = [name for name in COMPRESSING if not _needs_input(name)]


def small(method: str, budget: int = 48, window: int = 8, **fields) -> snapkv.Method:
    """``method`` at a budget tiny models can exceed (fields a method does not read are dropped)."""
    if method not in COMPRESSING:
        return snapkv.build_config(method)
    return snapkv.build_config(method, **{"budget": budget, "window": window, "kernel": 5, **fields})


def with_every_method(settings: list, distinct_from: int | None = None, step: int = 8, **size) -> list:
    """``settings`` plus each registered method none of them uses, at its test size (or ``size``);
    with ``distinct_from``, the added methods get budgets ``distinct_from``, ``+ 8``, ... so that each
    keeps a cache length of its own."""
    used = {cfg.method for cfg in settings}
    added = [name for name in REGISTERED if name not in used and not _needs_input(name)]
    if distinct_from is None:
        return list(settings) + [small(name, **size) for name in added]
    return list(settings) + [small(name, budget=distinct_from + step * i, **size) for i, name in enumerate(added)]
