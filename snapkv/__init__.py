"""snapkv: KV-cache prompt compression (SnapKV and baselines) for Hugging Face transformers."""
from .method import Method, InputError, build_config, METHODS, POOLINGS, GQA_MODES
from .methods import (AdaKV, CriticalAdaKV, ExpectedAttention, FullKV, H2O, KeyDiff, Knorm, KVzip,
                      PyramidKV, RandomKeep, SnapKV, StreamingLLM, TOVA)
from .hooks import CompressionSession, compress
from .merge import merge_caches
from .kept import kept_positions
from .select import select_positions
from .chunking import chunked_mlp

SnapKVConfig = SnapKV  # the name the Python API contract (DESIGN.md 3.1) gives SnapKV's settings

__all__ = [
    "Method", "InputError", "build_config", "METHODS", "POOLINGS", "GQA_MODES", "AdaKV", "CriticalAdaKV",
    "ExpectedAttention", "FullKV", "H2O", "KeyDiff", "Knorm", "KVzip", "PyramidKV", "RandomKeep", "SnapKV",
    "SnapKVConfig", "StreamingLLM", "TOVA", "CompressionSession",
    "compress", "merge_caches", "kept_positions", "select_positions", "chunked_mlp",
]
