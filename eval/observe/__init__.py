"""SnapKV's observation (its §3-4): what each head attends to while generating is already visible
from the last window of the prompt. ``python -m eval.observe`` measures it as hit rates."""

RESPONSES = ("reference", "model")       # observe.response: the dataset's answer, or the model's own
VARIANTS = ("hits", "instructions")      # observe.variant: Figures 2-3, or the instruction-overlap check
