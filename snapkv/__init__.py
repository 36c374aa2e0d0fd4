"""snapkv: KV-cache prompt compression (SnapKV and baselines) for Hugging Face transformers."""
from .method import Method, InputError, build_config, METHODS, POOLINGS, GQA_MODES
from .methods import (FullKV, H2O, PyramidKV, RandomKeep, SnapKV,
                      StreamingLLM)
from .hooks import CompressionSession, compress
from .merge import merge_caches
from .select import select_positions
from .chunking import chunked_mlp

SnapKVConfig = SnapKV  # the name the Python API contract (DESIGN.md 3.1) gives SnapKV's settings

__all__ = [
    "Method", "InputError", "build_config", "METHODS", "POOLINGS", "GQA_MODES", "FullKV", "H2O",
    "PyramidKV", "RandomKeep", "SnapKV", "SnapKVConfig", "StreamingLLM", "CompressionSession",
    "compress", "merge_caches", "select_positions", "chunked_mlp",
]
