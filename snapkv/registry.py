"""The one list of methods: each method's file registers its class here (``@register``).

This module imports no method: ``snapkv.methods`` imports every file of its folder, and each file fills
the registry as it is imported. Every list of method names elsewhere (Hydra's ``compressor`` options,
the leaderboard's entries, ``snapkv.__all__``, the docs' method tables) is generated from ``METHODS``
or checked against it by a test.
"""
from __future__ import annotations

from dataclasses import fields

from .errors import InputError, check_choice

METHODS: dict[str, type] = {}

# the fields every option of the ``compressor`` group carries: a method that does not read one ignores it
SHARED_FIELDS = ("budget", "ratio", "window", "kernel", "pooling", "gqa")


def register(cls):
    """Class decorator of a method's file: adds the method under its name ``cls.method``."""
    if cls.method in METHODS and METHODS[cls.method] is not cls:
        raise ValueError(f"two methods are named {cls.method!r}: {METHODS[cls.method].__name__} and {cls.__name__}")
    METHODS[cls.method] = cls
    return cls


def build_config(method: str, **values):
    """Build a method's config from loose values (e.g. a Hydra node).

    Fields common to the compressor config group (budget, ratio, window, kernel, pooling, gqa) that a
    method does not use are dropped, so one sweep can cover several methods; any other unknown field is
    an error.
    """
    check_choice("compressor.method", method, sorted(METHODS))
    cls = METHODS[method]
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known - set(SHARED_FIELDS)
    if unknown:
        raise InputError(
            f"compressor.{sorted(unknown)[0]} is not a field of {method}; allowed: {', '.join(sorted(known))}"
        )
    return cls(**{k: v for k, v in values.items() if k in known})


def scoring_methods() -> list[str]:
    """The methods that score prompt positions, so that a wrapper (AdaKV, CriticalAdaKV) can take any of
    them as its ``scorer`` (``Method.scores_positions``)."""
    return sorted(name for name, cls in METHODS.items() if cls.scores_positions)


PLACEMENTS = ("agnostic", "aware")  # kvpress's leaderboard: the question outside or inside the compressed context


def kvpress_entries(placement: str | None = None) -> dict[str, tuple[str, str, dict]]:
    """Every kvpress registry entry a method's file declares (``Method.kvpress_entries``), as
    option -> (method, kvpress's entry name, the fields it sets); with ``placement``, only the entries of
    that board of kvpress's leaderboard. An entry's declaration may name the method it runs (``"method"``,
    default: the declaring method; e.g. compactor's file declares ``adakv_compactor``, AdaKV over it), its
    option (``"option"``), its boards (``"placements"``, default ``("agnostic",)``) and a note on its parity
    with kvpress for the docs (``"parity"``, default: equal, tested); otherwise the option
    is the method's own when the entry sets no field, else ``<method>_<entry>``. Full KV's entry
    (``no_press``) is the baseline of both boards."""
    if placement is not None:
        check_choice("placement", placement, PLACEMENTS)
    out = {}
    for name, cls in sorted(METHODS.items()):
        for press, declared in cls.kvpress_entries.items():
            fields = dict(declared)
            method = fields.pop("method", name)
            fields.pop("parity", None)  # the docs' note on its parity with kvpress
            placements = fields.pop("placements", PLACEMENTS if not METHODS[method]().compresses else ("agnostic",))
            option = fields.pop("option", None) or (method if not fields and method == name else f"{method}_{press}")
            if placement is not None and placement not in placements:
                continue
            if option in out:
                raise ValueError(f"kvpress entries {out[option][1]!r} and {press!r} both make the option {option!r}")
            out[option] = (method, press, fields)
    return out
