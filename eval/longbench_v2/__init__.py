"""LongBench v2 (THUDM/LongBench-v2): 503 long-context multiple-choice questions, as an engine task.

The prompts, middle truncation, generation lengths and answer extraction follow the official
``pred.py`` of THUDM/LongBench (its top level, the v2 code), the accuracy table ``result.py``; see
docs/longbench_v2.md for the protocol and its deviations.
"""
