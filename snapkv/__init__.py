"""snapkv: KV-cache prompt compression (SnapKV and baselines) for Hugging Face transformers."""
from .config import CompressorConfig, InputError, build_config, METHODS, POOLINGS, GQA_MODES
from .methods import (FullConfig, H2OConfig, PyramidKVConfig, RandomConfig, SnapKVConfig,
                      StreamingLLMConfig)
from .patch import CompressionSession, compress
from .merge import merge_caches
from .select import select_positions
from .chunking import chunked_mlp

__all__ = [
    "CompressorConfig", "InputError", "build_config", "METHODS", "POOLINGS", "GQA_MODES", "FullConfig", "H2OConfig",
    "PyramidKVConfig", "RandomConfig", "SnapKVConfig", "StreamingLLMConfig", "CompressionSession",
    "compress", "merge_caches", "select_positions", "chunked_mlp",
]
