# The README's commands. Everything runs inside a local virtualenv (.venv).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := demo-out
# Where pip finds torch: empty takes pip's own configuration (a machine with local wheels gets
# its CPU build); on plain PyPI, where torch==2.13.0 is the CUDA build, give the CPU index:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu demo
TORCH_INDEX ?=

.PHONY: install demo test lint bench bench-quick gpu-check docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))  # first: a loose range pulls newer builds
	$(BIN)/pip install -q -e '.[dev,examples]'
	touch $(STAMP)

install: $(STAMP)

# two test processes (pytest-xdist): most tests wait on ranks, and the suite took 18 minutes of
# CI's 2 cores in one; --durations names the slowest, for keeping CI within its 15 minutes
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# A small emulated cluster: 4 workers on 4 emulated hosts with slow regimes that come and go.
CLUSTER := synthetic:base_s=0.02,p_slow=0.03,p_recover=0.1,slow_factor=4

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/bdsgd profile --workers 4 --iterations 300 --traces $(DEMO)/traces --stragglers $(CLUSTER) --seed 0
	$(BIN)/bdsgd fit --traces $(DEMO)/traces --checkpoint $(DEMO)/model.pt --steps 300
	# every policy on the profile's held-out last 20% (fit trained on the first 80%)
	$(BIN)/bdsgd simulate --traces $(DEMO)/traces --checkpoint $(DEMO)/model.pt --from-frac 0.8 \
		--out $(DEMO)/simulate
	# every rank trains; the first c gradients of each iteration are summed in one all-reduce
	$(BIN)/bdsgd train --workers 4 --iterations 80 --policy full --traces $(DEMO)/traces \
		--out $(DEMO)/run-full --stragglers $(CLUSTER) --seed 0
	$(BIN)/bdsgd train --workers 4 --iterations 80 --policy bdsgd --checkpoint $(DEMO)/model.pt \
		--traces $(DEMO)/traces --out $(DEMO)/run-bdsgd --stragglers $(CLUSTER) --seed 0
	$(BIN)/bdsgd report $(DEMO)/run-full $(DEMO)/run-bdsgd $(DEMO)/simulate --out $(DEMO)/report
	@echo "demo done: plots and index in $(DEMO)/report/index.md"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --out docs/benchmarks-generated.md

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --out bench-out/benchmarks.md --quick

# Everything only a GPU exercises (CUDA tests, NCCL at world size 1, ranks sharing a GPU over
# gloo, the examples in bf16), a few minutes on one H100; CUDA parts skip, saying so, elsewhere.
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check --out bench-out/gpu-check.md

docs: $(STAMP)
	$(BIN)/python -m bdsgd_cli.docs docs/cli.md

clean:
	rm -rf $(DEMO) .pytest_cache
