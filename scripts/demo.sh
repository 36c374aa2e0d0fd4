#!/usr/bin/env bash
# The whole workflow on the embedded default (SmolLM2-135M on CPU, offline), in minutes:
# a budget x pooling sweep on bundled LongBench rows, a needle grid for full KV vs SnapKV vs
# StreamingLLM, a small RULER part, the observation-window hit rates, a speed/memory benchmark, then
# tables and figures under results/demo/.
#   bash scripts/demo.sh [all|longbench|needle|ruler|observe|bench]   (make demo = all; make longbench,
#   make needle and make observe without MODEL run their part, with a report of that part under
#   results/report/demo-<part>/)
# The parts and their overrides are in scripts/demo.py, which runs them in one process (one import
# of the libraries, one model load) and prints each part's command and time.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo.py "${1:-all}"
