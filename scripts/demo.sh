#!/usr/bin/env bash
# The whole workflow on the embedded default (SmolLM2-135M on CPU, offline), in minutes:
# a budget x pooling sweep on bundled LongBench rows, a needle grid for full KV vs SnapKV,
# a speed/memory benchmark, then tables and figures under results/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=results/runs/demo
$PY -m eval.longbench experiment=demo compressor=full hydra.run.dir=$RUNS/longbench/smollm2-135m/full
$PY -m eval.longbench -m experiment=demo compressor.budget=256,512 compressor.pooling=maxpool,avgpool \
    hydra.sweep.dir=$RUNS/longbench
$PY -m eval.needle experiment=demo compressor=full hydra.run.dir=$RUNS/needle/smollm2-135m/full
$PY -m eval.needle experiment=demo compressor.budget=256 hydra.run.dir=$RUNS/needle/smollm2-135m/snapkv-b256
$PY -m eval.bench experiment=demo hydra.run.dir=$RUNS/bench/smollm2-135m
$PY -m eval.report report.runs=$RUNS report.out=results/demo \
    "report.label='SmolLM2-135M-Instruct (Q4_1 GGUF, float32) on CPU ($(nproc) cores); command: make demo'"
echo "demo done: tables and figures in results/demo/"
