"""One compression method a file; importing this package registers them all (one import line a method:
the registry, ``snapkv.METHODS``, is filled by ``@register``)."""
from .full import FullKV
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .h2o import H2O
from .streamingllm import StreamingLLM
from .random import RandomKeep
from .knorm import Knorm
from .tova import TOVA
from .keydiff import KeyDiff
from .expected_attention import ExpectedAttention
from .adakv import AdaKV
from .critical_adakv import CriticalAdaKV
from .kvzip import KVzip
