# The two commands of the README: `make run` (the service with its demo collection) and
# `make test`. Both set up everything they need on a fresh machine, into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,server

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

DISKANN_VENV := bench/work/diskann-venv

bench:
	$(MAKE) setup EXTRAS=test,server,bench
	test -x $(DISKANN_VENV)/bin/python || python3 -m venv $(DISKANN_VENV)
	$(DISKANN_VENV)/bin/pip install -q -r bench/requirements-diskann.txt
	$(PY) bench/run.py --scaling 100k 1m
