"""The ``compressor`` config group, generated from the methods' dataclasses (``snapkv.METHODS``).

Each method's fields and defaults are declared once, in its dataclass; this module turns each into
the Hydra option ``compressor=<method>`` (registered in Hydra's ConfigStore when ``eval`` is
imported). Every option carries the same keys, null where a method has no such field, so a sweep
such as ``compressor=full,snapkv compressor.budget=1024`` composes for every method (``build_config``
drops the fields a method does not read). The budget default becomes null once ``compressor.ratio``
is set, and the run tag names every field that changes what is kept (``Method.tag_template``).
"""
from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

import snapkv

# the fields of the option every method carries, in this order
SHARED_FIELDS = ("budget", "ratio", "window", "kernel", "pooling", "gqa")


def _interpolated(part: str) -> str:
    return part.replace("{", "${.")


def option(cls) -> dict:
    """The config node of ``compressor=<cls.method>``."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    if not cls().compresses:
        return {"method": cls.method, **{name: None for name in SHARED_FIELDS}, "tag": cls.method}
    node = {"method": cls.method}
    for name in SHARED_FIELDS:
        node[name] = None if name not in defaults or name in cls.derived else defaults[name]
    node["budget"] = f"${{budget_unless_ratio:${{.ratio}},{defaults['budget']}}}"
    node.update({name: value for name, value in defaults.items() if name not in node and name not in cls.derived})
    tag = "-".join([cls.method, "${size_tag:${.budget},${.ratio}}", *map(_interpolated, cls.tag_template())])
    node["tag"] = tag
    return node


def register_options() -> None:
    store = ConfigStore.instance()
    for name, cls in sorted(snapkv.METHODS.items()):
        store.store(group="compressor", name=name, node=option(cls), provider="snapkv")


register_options()
