"""AIME25 and MATH-500 as engine tasks: long generations scored on their final boxed answer.

Reference: NVIDIA/kvpress ``evaluation/`` (``evaluate.py``, ``evaluate_registry.py`` and
``benchmarks/aime25/calculate_metrics.py``, ``benchmarks/math500/calculate_metrics.py``) with its
``KVPressTextGenerationPipeline`` (``kvpress/pipeline.py``, kvpress 0.5.5): the hub datasets
``alessiodevoto/aime25`` and ``alessiodevoto/math500`` (split ``test``; columns ``context``, ``question``,
``answer_prefix``, ``answer``, ``max_new_tokens``), the pipeline's prompt, greedy decoding up to each
row's ``max_new_tokens``, and kvpress's own scorer (``eval.math.score``), with a math-equivalence column
from the ``math-verify`` package beside it. docs/math.md has the protocol and the deviations.
"""
