"""OmegaConf resolvers the configs use; registered when ``eval`` is imported (before Hydra composes).

- ``${budget_unless_ratio:${.ratio},1024}``: a compressor's default budget, null once a ratio is set,
  so ``compressor.ratio=0.5`` alone is a complete setting (setting both is refused by the method);
- ``${size_tag:${.budget},${.ratio}}``: ``b1024`` or ``r0.5``, the size part of a run tag;
- ``${decoding_tag:...}``: ``""`` or ``-dt512-di128-db256``, the run tag's part for compression while decoding
  (``snapkv.method.decoding_tag``);
- ``${query_suffix:${query_aware}}``: ``""`` or ``-query-agnostic``, the folder suffix of runs whose
  question is appended after compression;
- ``${decoding_suffix:${decoding}}``: ``""``, ``-lookup10`` or ``-assisted10``, the folder suffix of runs decoding
  speculatively (``eval.speculation.decoding_suffix``).
"""
from __future__ import annotations

from omegaconf import OmegaConf

from snapkv.method import decoding_tag

from .speculation import decoding_suffix


def budget_unless_ratio(ratio, default):
    return default if ratio is None else None


def size_tag(budget, ratio) -> str:
    return f"b{budget}" if ratio is None else f"r{ratio:g}" if isinstance(ratio, (int, float)) else f"r{ratio}"


def query_suffix(query_aware) -> str:
    return "" if query_aware in (True, "true", "True") else "-query-agnostic"


for _name, _fn in (("budget_unless_ratio", budget_unless_ratio), ("size_tag", size_tag),
                   ("query_suffix", query_suffix), ("decoding_tag", decoding_tag),
                   ("decoding_suffix", decoding_suffix)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)
