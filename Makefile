# The two commands a fresh machine needs:
#   make repro   set up .venv and run the pipeline on the offline default (dvc repro)
#   make test    set up .venv and run the test suite
VENV := .venv
PYTHON ?= python3
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1
# pip byte-compiles every file it installs, a third of the install here (~55 s of ~140 s on 2 cores); with
# --no-compile only the modules the pipeline imports are compiled, on first import. That needs Python to
# write bytecode, so a PYTHONDONTWRITEBYTECODE from outside is not passed on to what make runs.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup repro test test-fast clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

repro: setup
	dvc repro

test: setup
	ruff check .
	ruff format --check .
	python -m pytest -q --durations=30

test-fast: setup
	python -m pytest -q -m "not slow and not ddp"

clean-venv:
	rm -rf $(VENV)
