"""Write what is generated from the method registry: conf/compressor/<option>.yaml for every registered
method and kvpress entry (eval/compressor_configs.py), the method tables of docs/methods.md,
docs/library.md and docs/leaderboard.md (eval/method_tables.py), and the leaderboard presets' compressor lists
(eval/leaderboard.py); tests/test_methods.py fails when a file differs from what this writes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.compressor_configs import write_options  # noqa: E402
from eval.leaderboard import write_presets  # noqa: E402
from eval.method_tables import write_tables  # noqa: E402

if __name__ == "__main__":
    for path in [*write_options(), *write_tables(), *write_presets()]:
        print(path)
