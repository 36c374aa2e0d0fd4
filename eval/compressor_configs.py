"""The ``compressor`` config group, generated from the methods' dataclasses (``snapkv.METHODS``).

Each method's fields and defaults are declared once, in its dataclass; this module turns each into
the Hydra option ``compressor=<method>`` (registered in Hydra's ConfigStore when ``eval`` is
imported). Every option carries the same keys, null where a method has no such field, so a sweep
such as ``compressor=full,snapkv compressor.budget=1024`` composes for every method (``build_config``
drops the fields a method does not read). The budget default becomes null once ``compressor.ratio``
is set, and the run tag names every field that changes what is kept (``Method.tag_template``).

The built-in methods' options are also written out as ``conf/compressor/<method>.yaml``
(``python scripts/write_compressor_configs.py``), because the command-line contract names them as files; a
test keeps each file equal to what this module generates. A method without a file (a new one) is
registered in Hydra's ConfigStore instead, so its file and one import line are all it needs.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import snapkv
from snapkv.registry import kvpress_entries

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
    sized = "budget" not in cls.derived  # a method keeping every token (fewer key channels) has no size in tokens
    if sized:
        node["budget"] = f"${{budget_unless_ratio:${{.ratio}},{defaults['budget']}}}"
    node.update({name: value for name, value in defaults.items() if name not in node and name not in cls.derived})
    size = ["${size_tag:${.budget},${.ratio}}"] if sized else []
    tag = "-".join([cls.method, *size, *map(_interpolated, cls.tag_template())])
    if cls().scores_while_decoding and not cls().cannot_decode():  # compression while decoding, when set
        tag += "${decoding_tag:${.decode_target},${.decode_ratio},${.decode_interval},${.decode_buffer},"
        tag += "${.decode_query_positions}}"
    node["tag"] = tag
    return node


OPTIONS_DIR = Path(__file__).resolve().parent.parent / "conf" / "compressor"


def option_text(cls) -> str:
    """``conf/compressor/<method>.yaml`` as this module writes it."""
    source = f"snapkv/methods/{cls.__module__.rsplit('.', 1)[-1]}.py"
    header = (f"# compressor={cls.method}: generated from {cls.__name__} ({source}) by\n"
              "# `python scripts/write_compressor_configs.py`; edit the dataclass, not this file.\n")
    return header + OmegaConf.to_yaml(OmegaConf.create(option(cls)), sort_keys=False)


def entry_options() -> dict[str, tuple[str, str, dict]]:
    """The options of kvpress registry entries that are not a method's own option (``snapkv.registry.
    kvpress_entries``): option -> (method, kvpress's entry name, fields); e.g. ``adakv_expected_attention``."""
    return {option: entry for option, entry in kvpress_entries().items() if option != entry[0]}


def entry_option_text(option_name: str) -> str:
    """``conf/compressor/<option>.yaml`` of a kvpress entry: its method's option and the entry's fields."""
    method, press, fields = entry_options()[option_name]
    cls = snapkv.METHODS[method]
    header = (f"# compressor={option_name}: kvpress's registry entry {press!r}, {cls.__name__} with the fields below;\n"
              f"# generated from {cls.__name__}.kvpress_entries by `python scripts/write_compressor_configs.py`.\n")
    return header + OmegaConf.to_yaml(OmegaConf.create({"defaults": [method, "_self_"], **fields}), sort_keys=False)


def generated_options() -> dict[str, str]:
    """Every generated option file's name and text: each method's, then each kvpress entry's."""
    texts = {f"{name}.yaml": option_text(cls) for name, cls in sorted(snapkv.METHODS.items())}
    texts.update({f"{name}.yaml": entry_option_text(name) for name in entry_options()})
    return texts


def write_options() -> list[Path]:
    written = []
    for name, text in generated_options().items():
        path = OPTIONS_DIR / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def register_options() -> None:
    store = ConfigStore.instance()
    for name, cls in sorted(snapkv.METHODS.items()):
        if not (OPTIONS_DIR / f"{name}.yaml").exists():
            store.store(group="compressor", name=name, node=option(cls), provider="snapkv")
    for name, (method, _, fields) in entry_options().items():
        if not (OPTIONS_DIR / f"{name}.yaml").exists():
            store.store(group="compressor", name=name, node={**option(snapkv.METHODS[method]), **fields},
                        provider="snapkv")


register_options()
