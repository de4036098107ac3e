# The two commands of the README: `make run` (the service with its demo collection) and
# `make test`. Both set up everything they need on a fresh machine, into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,server,loadtest

.PHONY: setup run test bench

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned: on a machine without a GPU this takes the CPU build; left to
# another package's requirements pip would pull a multi-GB CUDA build.
setup: $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"

run: setup
	$(VENV)/bin/fusionrag serve

test: setup
	$(PY) -m pytest -q

bench:
	$(MAKE) setup EXTRAS=test,server,bench
	$(PY) bench/run.py
