"""snapkv: KV-cache prompt compression (SnapKV and baselines) for Hugging Face transformers.

Every registered method's class is exported under its own name (``snapkv.SnapKV``, ``snapkv.AdaKV``, ...):
the list is the registry's (``snapkv.METHODS``), filled by the files of ``snapkv/methods/``.
"""
from . import methods as _methods  # noqa: F401  (each method's file registers it)
from .cache_state import speculating, tokens_before_cut
from .chunking import chunked_mlp
from .errors import InputError
from .hooks import CompressionSession, compress
from .kept import decoding_rankings, kept_positions, ranking_scores
from .merge import merge_caches
from .method import GQA_MODES, POOLINGS, Method
from .registry import METHODS, build_config
from .select import select_positions

_METHOD_CLASSES = {cls.__name__: cls for cls in METHODS.values()}
globals().update(_METHOD_CLASSES)
SnapKVConfig = METHODS["snapkv"]  # the name the Python API contract (DESIGN.md 3.1) gives SnapKV's settings

__all__ = [
    "Method", "InputError", "build_config", "METHODS", "POOLINGS", "GQA_MODES", "SnapKVConfig",
    "CompressionSession", "compress", "merge_caches", "kept_positions", "ranking_scores", "decoding_rankings",
    "select_positions", "chunked_mlp", "speculating", "tokens_before_cut",
    *sorted(_METHOD_CLASSES),
]
