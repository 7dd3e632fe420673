# jaxmon: `make train` and `make test` set themselves up in .venv/ from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install test train lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jaxmon needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

train: $(STAMP)
	$(VENV)/bin/jaxmon train --config configs/default.py --workdir runs/default

lint: $(STAMP)
	$(PY) -m ruff check jaxmon tests examples benchmarks configs

clean:
	rm -rf $(VENV) runs .pytest_cache
