# attnlab: `make test` and `make demo` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-floors lint demo bench bench-variants clean

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

# The suite on every core (at most 4 processes; each test runs torch on one thread):
# `pytest -q` alone runs it in one process.
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# The oldest versions pyproject.toml allows, on the oldest Python it allows (FLOORS_PY):
# uv resolves every direct dependency to its lowest version (what those need, to the
# newest) and installs them into plain venvs (which, below Python 3.12, hold the setuptools
# torch.compile needs). ruff and the suite run as in `test`, first with the dev extras,
# then with the runtime dependencies and pytest alone (tests that need a dev extra skip).
# The venvs go to .venv-floors; torch's CUDA wheels make it a download of about 3 GB.
FLOORS_PY ?= python3.10
FLOORS := .venv-floors
UV := $(FLOORS)/uv/bin/python -m uv

test-floors:
	rm -rf $(FLOORS)
	$(PY) -m venv $(FLOORS)/uv
	$(FLOORS)/uv/bin/python -m pip install --quiet uv
	$(FLOORS_PY) -m venv $(FLOORS)/dev
	$(FLOORS_PY) -m venv $(FLOORS)/runtime
	$(UV) pip compile --quiet --resolution lowest-direct --python $(FLOORS)/dev/bin/python \
		--extra dev pyproject.toml -o $(FLOORS)/dev.txt
	echo "pytest>=7" > $(FLOORS)/pytest.in
	$(UV) pip compile --quiet --resolution lowest-direct --python $(FLOORS)/runtime/bin/python \
		pyproject.toml $(FLOORS)/pytest.in -o $(FLOORS)/runtime.txt
	$(UV) pip install --quiet --python $(FLOORS)/dev/bin/python -r $(FLOORS)/dev.txt
	$(UV) pip install --quiet --python $(FLOORS)/runtime/bin/python -r $(FLOORS)/runtime.txt
	$(FLOORS)/dev/bin/python -m ruff check .
	PYTHONPATH=$(CURDIR) $(FLOORS)/dev/bin/python -m pytest -q -p no:cacheprovider
	PYTHONPATH=$(CURDIR) $(FLOORS)/runtime/bin/python -m pytest -q -p no:cacheprovider

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
	rm -rf $(VENV) $(FLOORS) runs .pytest_cache .ruff_cache .attnlab_cache build dist *.egg-info
	find . -name __pycache__ -type d -not -path "./.venv/*" -prune -exec rm -rf {} +
