# The two commands a fresh machine needs:
#   make repro   set up .venv and run the pipeline on the offline default (dvc repro)
#   make test    set up .venv and run the test suite
VENV := .venv
PYTHON ?= python3
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup repro test test-fast clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

repro: setup
	dvc repro

test: setup
	python -m pytest -q

test-fast: setup
	python -m pytest -q -m "not slow and not ddp"

clean-venv:
	rm -rf $(VENV)
