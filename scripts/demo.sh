#!/usr/bin/env bash
# The whole workflow on the embedded default (SmolLM2-135M on CPU, offline), in minutes:
# a budget x pooling sweep on bundled LongBench rows, a needle grid for full KV vs SnapKV vs
# StreamingLLM, the observation-window hit rates, a speed/memory benchmark, then tables and
# figures under results/demo/.
#   bash scripts/demo.sh [all|longbench|needle|ruler|observe|bench]   (make demo = all; make longbench,
#   make needle and make observe without MODEL run their part, with a report of that part under
#   results/report/demo-<part>/)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=results/demo-runs   # not under results/runs: make tables over real runs never sees the demo's
PART=${1:-all}
LABEL="SmolLM2-135M-Instruct (Q4_1 GGUF, float32) on CPU ($(nproc) cores); command:"

# One job per part: full KV and every compressor setting share one prefill per prompt (full, which
# reads no budget or pooling, is one setting), and the settings decode as one batch
# (decode_together: a token may differ from a solo run where batched arithmetic rounds differently;
# docs/shared_prefill.md says how often it did here).
TOGETHER="hydra/sweeper=shared_prefill shared_prefill.decode_together=true"
longbench() {
  $PY -m eval.longbench -m $TOGETHER experiment=demo compressor=full,snapkv \
      compressor.budget=256,512 compressor.pooling=maxpool,avgpool hydra.sweep.dir=$RUNS/longbench
}
needle() {
  $PY -m eval.needle -m $TOGETHER experiment=demo compressor=full,snapkv,streamingllm \
      compressor.budget=256 hydra.sweep.dir=$RUNS/needle
}
ruler() {  # query-aware and not: two jobs (the prefills differ), each sharing its prefill
  $PY -m eval.ruler -m $TOGETHER experiment=demo compressor=full,snapkv \
      compressor.budget=256 query_aware=true,false hydra.sweep.dir=$RUNS/ruler
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

TIMES=()
timed() {  # timed PART ARGS...: run a part and remember how long it took
  local started=$SECONDS
  "$@"
  TIMES+=("$1 $((SECONDS - started)) s")
}
# The machine's speed, so that the times below can be compared with the README's.
$PY -c "import time, torch; a = torch.randn(2048, 2048); a @ a; t = time.perf_counter(); [a @ a for _ in range(5)]; \
print(f'machine: {5 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9:.0f} GFLOPS float32 matmul on {torch.get_num_threads()} threads')"

case "$PART" in
  all) timed longbench; timed needle; timed ruler; timed observe; timed bench; timed report $RUNS results/demo "make demo" ;;
  longbench|needle|ruler|observe|bench) timed $PART; timed report $RUNS/$PART results/report/demo-$PART "make $PART" ;;
  *) echo "usage: scripts/demo.sh [all|longbench|needle|ruler|observe|bench]" >&2; exit 2 ;;
esac
printf 'time per part: %s\n' "$(IFS=';'; echo "${TIMES[*]}")"
echo "demo ($PART) done"
