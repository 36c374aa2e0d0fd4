"""One compression method a file; importing this package registers them all."""
from .full import FullKV
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .h2o import H2O
from .streamingllm import StreamingLLM
from .random import RandomKeep

__all__ = ["FullKV", "SnapKV", "PyramidKV", "H2O", "StreamingLLM", "RandomKeep"]
