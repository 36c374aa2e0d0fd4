#!/usr/bin/env bash
# The whole workflow on the embedded default (SmolLM2-135M on CPU, offline), in minutes:
# a budget x pooling sweep on bundled LongBench rows, a needle grid for full KV vs SnapKV vs
# StreamingLLM, the observation-window hit rates, a speed/memory benchmark, then tables and
# figures under results/demo/.
#   bash scripts/demo.sh [all|longbench|needle|observe|bench]   (make demo = all; make longbench,
#   make needle and make observe without MODEL run their part, with a report of that part under
#   results/report/demo-<part>/)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=results/demo-runs   # not under results/runs: make tables over real runs never sees the demo's
PART=${1:-all}
LABEL="SmolLM2-135M-Instruct (Q4_1 GGUF, float32) on CPU ($(nproc) cores); command:"

longbench() {
  $PY -m eval.longbench experiment=demo compressor=full hydra.run.dir=$RUNS/longbench/smollm2-135m/full
  $PY -m eval.longbench -m experiment=demo compressor.budget=256,512 compressor.pooling=maxpool,avgpool \
      hydra.sweep.dir=$RUNS/longbench
}
needle() {
  $PY -m eval.needle experiment=demo compressor=full hydra.run.dir=$RUNS/needle/smollm2-135m/full
  $PY -m eval.needle -m experiment=demo compressor=snapkv,streamingllm compressor.budget=256 \
      hydra.sweep.dir=$RUNS/needle
}
observe() {
  $PY -m eval.observe experiment=demo hydra.run.dir=$RUNS/observe/smollm2-135m
}
bench() {
  $PY -m eval.bench experiment=demo hydra.run.dir=$RUNS/bench/smollm2-135m
}
report() {  # report RUNS_SUBDIR OUT COMMAND
  $PY -m eval.report report.runs=$1 report.out=$2 "report.label='$LABEL $3'"
}

case "$PART" in
  all) longbench; needle; observe; bench; report $RUNS results/demo "make demo" ;;
  longbench|needle|observe|bench) $PART; report $RUNS/$PART results/report/demo-$PART "make $PART" ;;
  *) echo "usage: scripts/demo.sh [all|longbench|needle|observe|bench]" >&2; exit 2 ;;
esac
echo "demo ($PART) done"
