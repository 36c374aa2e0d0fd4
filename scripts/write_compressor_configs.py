"""Write conf/compressor/<method>.yaml for every registered method, from its dataclass
(eval/compressor_configs.py); tests/test_methods.py fails when a file differs from what this writes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.compressor_configs import write_options  # noqa: E402

if __name__ == "__main__":
    for path in write_options():
        print(path)
