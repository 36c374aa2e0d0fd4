"""One compression method a file; importing this package registers them all."""
from .full import FullConfig
from .snapkv import SnapKVConfig
from .pyramidkv import PyramidKVConfig
from .h2o import H2OConfig
from .streamingllm import StreamingLLMConfig
from .random import RandomConfig

__all__ = ["FullConfig", "SnapKVConfig", "PyramidKVConfig", "H2OConfig", "StreamingLLMConfig", "RandomConfig"]
