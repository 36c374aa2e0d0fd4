"""Every registered method at a test size: the list that drives the generic tests. A method added
to ``snapkv/methods/`` (its file and one import line) is covered by them without touching a test."""
from __future__ import annotations

import snapkv

REGISTERED = sorted(snapkv.METHODS)
COMPRESSING = [name for name in REGISTERED if snapkv.METHODS[name]().compresses]


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
    added = [name for name in REGISTERED if name not in used]
    if distinct_from is None:
        return list(settings) + [small(name, **size) for name in added]
    return list(settings) + [small(name, budget=distinct_from + step * i, **size) for i, name in enumerate(added)]
