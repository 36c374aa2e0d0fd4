"""snapkv: KV-cache prompt compression (SnapKV and baselines) for Hugging Face transformers."""
from .method import Method, InputError, build_config, METHODS, POOLINGS, GQA_MODES
from .methods import (FullKV, H2O, PyramidKV, RandomKeep, SnapKV,
                      StreamingLLM)
from .hooks import CompressionSession, compress
from .merge import merge_caches
from .select import select_positions
from .chunking import chunked_mlp

__all__ = [
    "Method", "InputError", "build_config", "METHODS", "POOLINGS", "GQA_MODES", "FullKV", "H2O",
    "PyramidKV", "RandomKeep", "SnapKV", "StreamingLLM", "CompressionSession",
    "compress", "merge_caches", "select_positions", "chunked_mlp",
]
