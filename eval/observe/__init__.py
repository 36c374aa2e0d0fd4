"""SnapKV's observation (its §3-4): what each head attends to while generating is already visible
from the last window of the prompt. ``python -m eval.observe`` measures it as hit rates."""
