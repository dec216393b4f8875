# attnlab: `make test` and `make demo` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench bench-variants clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch==2.13.0 is the local CPU wheel on these machines; an unpinned torch would pull CUDA builds.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/python -m ruff check .

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/attnlab train --preset demo --out runs/demo --overwrite
	$(BIN)/attnlab generate --ckpt runs/demo --prompt "The " --max-new-tokens 400 --temperature 0.8 --seed 0

bench: $(STAMP)
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/vs_transformers.py
	$(BIN)/python benchmarks/linear_layout.py
	$(BIN)/python benchmarks/time_to_quality.py
	$(BIN)/python benchmarks/mfu.py

bench-variants: $(STAMP)
	$(BIN)/python benchmarks/attention_variants.py --seconds 30
	$(BIN)/python benchmarks/sparse_decode.py

# The project's build outputs and caches (the token cache now lives in ~/.cache/attnlab:
# `rm -rf "$${XDG_CACHE_HOME:-$$HOME/.cache}/attnlab"` clears it).
clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .attnlab_cache build dist *.egg-info
	find . -name __pycache__ -type d -not -path "./.venv/*" -prune -exec rm -rf {} +
