# Two entry points that work on a fresh machine: `make bench` (the main job) and `make test`.
# Both create .venv in the checkout and install the project into it first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch comes from: empty for pip's default index; https://download.pytorch.org/whl/cpu for the CPU build
# on machines where the default index serves the CUDA one.
TORCH_INDEX ?=

.PHONY: install warmup bench test test-fast test-cudasim docs dashboard dashboard-assets compile-check-sm70 clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[torch,cuda,test,bench,notebook,docs]"
	# Headless Chromium for the offline-dashboard test: Debian's package (about 80 MB, half a minute), installed
	# only where that is cheap and allowed: as root, with apt-get, when absent, unless NO_CHROMIUM=1. Elsewhere
	# the test skips and says why.
	@if [ -z "$(NO_CHROMIUM)" ] && ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	    command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium) >/dev/null 2>&1 || echo "chromium not installed: the offline dashboard test will skip"; fi
	touch $(STAMP)

install: $(STAMP)

# Compile (or load from numba's on-disk cache) every CPU kernel and check it against the reference: about 2 min
# per dtype on 2 cores the first time on a machine, under a second afterwards, said up front instead of inside the
# first call.
warmup: $(STAMP)
	$(PY) -m numba_flash warmup

bench: warmup
	$(PY) -m numba_flash.bench

# Everything but the simulator suite, and beside it the CUDA simulator suite in processes of their own (the
# simulator must be switched on before numba.cuda is first imported), with the race, bounds and barrier checker on.
# The simulator is one Python thread per CUDA thread under one GIL: one process keeps one core busy. So the
# simulator suite runs in SIM_WORKERS processes (pytest-xdist), started before the warmup (it needs no CPU kernel)
# and niced: the warmup and the main suite, one chain, keep a core, the simulator takes the rest and, when the
# main suite is done, both cores. Its log follows the main suite's; either failing, or the warmup, fails.
# The tests run mods in float32 only: the warmup makes the kernels' variant for mods in float32 alone (each dtype's
# costs 3-4 minutes of compile on 2 cores).
# --durations: CI's log then says where the suite's time goes (the suite is to stay well under 30 minutes).
SIM_LOG := .test-cudasim.log
SIM_WORKERS ?= 2
test: $(STAMP)
	@NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 nice -n 10 $(PY) -m pytest -q -m cudasim -n $(SIM_WORKERS) \
	    --durations=30 >$(SIM_LOG) 2>&1 & sim=$$!; trap 'kill $$sim 2>/dev/null' INT TERM; \
	echo "== warmup (the CUDA simulator suite runs beside it and the main suite; its log follows) =="; \
	{ $(PY) -m numba_flash warmup --dtype float32 --mods && $(PY) -m numba_flash warmup --dtype float64; } \
	    || { kill $$sim 2>/dev/null; exit 1; }; \
	echo "== main suite =="; \
	$(PY) -m pytest -q --durations=30; main=$$?; \
	wait $$sim; sim_rc=$$?; \
	echo "== CUDA simulator suite: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 pytest -m cudasim -n $(SIM_WORKERS) =="; \
	cat $(SIM_LOG); \
	echo "main suite exit $$main, simulator suite exit $$sim_rc"; \
	test $$main = 0 && test $$sim_rc = 0

test-cudasim: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 $(PY) -m pytest -q -m cudasim -n $(SIM_WORKERS)

# The documentation site (mkdocs.yml, docs/) into site/; --strict makes any warning (a broken link or anchor, a
# docstring the API reference cannot read) an error, as tests/test_docs.py does.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# The asv dashboard (.asv/html) after `asv run`, made to work without a network: asv's page loads jQuery, flot and
# Bootstrap from CDNs, so tools/asv_offline.py vendors them from their npm packages next to the HTML. The
# tarballs are cached in .asv/npm-cache; `make dashboard-assets` fills that cache where the npm registry is
# reachable, to copy to an offline machine.
# A run that saved nothing (`asv run --python=same` without --set-commit-hash, --quick or not) is caught here and
# named, rather than ending in asv's "benchmarks.json missing" or an empty page. The page opens from disk too:
# tools/asv_offline.py inlines the JSON it would fetch, and prints the file:// address.
dashboard: $(STAMP)
	@ls .asv/results/*/*-*.json >/dev/null 2>&1 || { echo "make dashboard: no benchmark results in .asv/results:" \
	  "run 'asv machine --yes' once, then 'asv run --python=same --set-commit-hash \$$(git rev-parse HEAD)' (add" \
	  "--quick for a one-call-each run); with --python=same, a run without --set-commit-hash saves nothing" >&2; \
	  exit 1; }
	$(PY) -m asv publish
	$(PY) tools/asv_offline.py .asv/html

dashboard-assets:
	$(PYTHON) tools/asv_offline.py --fetch-only

# The V100 (sm_70) compile check: CUDA 13 dropped sm_70, so this builds a second environment with the CUDA 12
# toolchain (the 'cuda12' extra, about 800 MB) and runs the compile check for 7.0 in it. Not part of `make test`.
VENV12 := .venv-cu12
compile-check-sm70:
	test -x $(VENV12)/bin/python || $(PYTHON) -m venv $(VENV12)
	$(VENV12)/bin/python -m pip install -q -e ".[cuda12]"
	$(VENV12)/bin/python -m numba_flash.cuda.compile_check --cc 7.0

clean:
	rm -rf $(VENV) $(VENV12) .asv bench-out site
