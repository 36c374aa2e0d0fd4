"""LongEval-Lines (LongChat's line-retrieval test) as modified for SnapKV's pooling ablation (§5.2):
numbered lines with values, the model asked for one line's value."""
