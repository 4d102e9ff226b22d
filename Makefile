# Two entry points that work on a fresh machine: `make bench` (the main job) and `make test`.
# Both create .venv in the checkout and install the project into it first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install bench test test-fast test-cudasim clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[torch,cuda,test,bench]"
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(PY) -m numba_flash.bench

# Everything but the simulator suite, then the CUDA simulator suite in its own process (the simulator must be
# switched on before numba.cuda is first imported), with the race, bounds and barrier checker on.
test: $(STAMP)
	$(PY) -m pytest -q
	NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 $(PY) -m pytest -q -m cudasim

test-cudasim: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 $(PY) -m pytest -q -m cudasim

clean:
	rm -rf $(VENV) .asv bench-out
