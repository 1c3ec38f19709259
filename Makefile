# qlayer: the two commands of the README, and their parts.
#   make demo   start the local stack (Kafka + PostgreSQL, no Docker) and run the main job
#   make test   lint, type-check and run the whole test suite against a real broker and database
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qlayer-installed

.PHONY: install browser demo test lint typecheck unit integration acceptance bench bench-scale soak clean

NATIVE_SOURCES := native/Cargo.toml native/pyproject.toml $(wildcard native/src/*.rs)

# The native shard core (native/, Rust with PyO3) is built with maturin by pip; it needs cargo
# (rustup) on PATH. The Python core is the reference and runs without it (--core python).
$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) to build native/" >&2; exit 1; }
	$(PY) -m pip install --quiet ./native
	@touch $(STAMP)

install: $(STAMP)

# The console's browser test (tests/acceptance/test_console_browser.py) drives Debian's chromium
# through its chromedriver, never a downloaded browser. Installed with apt-get when missing (as
# root on Debian, like the local stack's PostgreSQL binaries); elsewhere install them by hand.
CHROMIUM := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver
browser:
	@if [ ! -x $(CHROMIUM) ] || [ ! -x $(CHROMEDRIVER) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver (apt-get) for the console's browser test"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else \
	    echo "$(CHROMIUM) and $(CHROMEDRIVER) are needed by the console's browser test: apt-get install -y chromium chromium-driver" >&2; \
	    exit 1; \
	  fi; \
	fi

# The demo starts the local stack if needed, migrates, runs its scenes (seconds once the
# stack is up) and leaves the stack running; `qlayer dev down` stops it.
demo: install
	$(VENV)/bin/qlayer demo

lint: install
	$(PY) -m ruff check .

typecheck: install
	$(PY) -m mypy

unit: install
	$(PY) -m pytest tests/unit

integration: install
	$(PY) -m pytest tests/integration

acceptance: install browser
	$(PY) -m pytest tests/acceptance

test: lint typecheck browser
	$(PY) -m pytest

# Side by side with the raw Kafka relay and Kafka share groups on the local stack (quick,
# ~5 minutes; BENCH_FULL=1 for the full matrix; BENCH_ARGS="--bootstrap-servers ... --database-url
# ..." for another stack). Writes benchmarks/results/bench.json and docs/benchmarks.md.
bench: install
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	$(PY) benchmarks/report.py

# The coordinator at scale: memory per queued message with 1,000,000 queued, restart to first
# delivery with 1,000,000 queued and 10,000 leased (~3 minutes on 2 cores, ~2 GiB of RSS;
# SCALE_ARGS="--messages 20000 --leased 1000" for a smoke run). Writes
# benchmarks/results/scale.json and regenerates docs/benchmarks.md.
bench-scale: install
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/scale.py $(SCALE_ARGS)
	$(PY) benchmarks/report.py

# The fault-injection soak (issue 15): a broker and PostgreSQL of its own, 100,000 records at
# 400/s through an at-least-once and an at-most-once queue, 4 consumers, 7 coordinator SIGKILLs
# with a standby, 6 consumer SIGKILLs, one broker SIGKILL, one PostgreSQL crash, a poison record
# and a deleted journal; then `qlayer pipeline reconcile` of both queues (Spark). Exits 1 when
# a record was lost or processed twice at most once, a shard rebuilt after poison input, or the
# audit found a violation. Prints a table per fault.
# SOAK_ARGS="--messages 20000 --rate 200" for a shorter one; `--help` lists every knob.
soak: install
	$(PY) -m tests.soak.run --output soak-result.json $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
