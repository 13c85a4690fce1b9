# Set-up is two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if missing.
# `make demo` installs the package alone (the sim demo needs neither torch nor the test tools); everything else
# installs it all: torch first, pinned, so pip takes the local CPU build instead of pulling CUDA wheels.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint bench bench-tuner readme screenshots clean

$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP) $(BASE)

demo: $(BASE)
	@echo "# make demo: offload-tuner alone (no torch, no test tools; make test installs them too)"
	$(VENV)/bin/offload-tuner demo --spec studies/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q -rs

test-fast: $(STAMP)    # everything but the tests marked slow (whole studies, hypothesis round trips): ~1 min
	$(PY) -m pytest -q -rs -m "not slow"

readme: $(STAMP)    # rewrites the README's example outputs from the program (tests/test_readme.py checks them)
	$(PY) tests/readme_examples.py --write

screenshots: $(STAMP)    # remakes the README's screenshots (docs/img) in a headless Chromium, from the program
	README_SCREENSHOTS=1 $(PY) -m pytest -q -rs tests/service/test_browser.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/planner_speed.py

bench-tuner: $(STAMP)    # ~5 min: the tuner against an exhaustive grid, TPE, random and a llama-optimus-like baseline
	$(PY) benchmarks/tuner_quality.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results
