# qlayer: the two commands of the README, and their parts.
#   make demo   start the local stack (Kafka + PostgreSQL, no Docker) and run the main job
#   make test   lint, type-check and run the whole test suite against a real broker and database
#   make check  the quick tier for every change: lint, type-check, the unit tests (fewer examples)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qlayer-installed

.PHONY: install browser jars demo check test lint typecheck unit integration acceptance bench bench-scale soak clean

NATIVE_SOURCES := native/Cargo.toml native/pyproject.toml $(wildcard native/src/*.rs)

# The native shard core (native/, Rust with PyO3) is built with maturin by pip; it needs cargo
# (rustup) on PATH. The Python core is the reference and runs without it (--core python).
# The built wheel is kept outside the checkout by the hash of native/'s sources and the
# interpreter's version, so a fresh clone (CI's) installs it in a second instead of building
# it for 30 s: cargo's own cache cannot serve a new clone (pyo3 rebuilds for every new
# interpreter path, and every clone has its own venv). Cargo builds in CARGO_TARGET_DIR.
# Set NATIVE_WHEELS and CARGO_TARGET_DIR to keep them elsewhere.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/qlayer/native-target
NATIVE_WHEELS ?= $(HOME)/.cache/qlayer/native-wheels
# mypy's cache outside the checkout too: it trusts an entry whose source hash matches, so a
# fresh clone checks only what changed (16 s -> a few on this machine).
export MYPY_CACHE_DIR ?= $(HOME)/.cache/qlayer/mypy
$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@key=$$(cat $(NATIVE_SOURCES) native/Cargo.lock | sha256sum | cut -c1-16)-$$($(PY) -c \
	  'import sys; print(sys.implementation.cache_tag)') && kept=$(NATIVE_WHEELS)/$$key && \
	if ! ls $$kept/*.whl >/dev/null 2>&1; then \
	  command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) to build native/" >&2; exit 1; }; \
	  made=$$(mktemp -d) && $(PY) -m pip wheel --quiet --no-deps -w $$made ./native && \
	  mkdir -p $(NATIVE_WHEELS) && { mv -T $$made $$kept 2>/dev/null || rm -rf $$made; }; \
	fi && $(PY) -m pip install --quiet --no-deps --force-reinstall $$kept/*.whl
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

# The suite runs on parallel workers (pytest-xdist) over one shared local stack; tests that
# share a broker of their own, or Spark, are kept on one worker each (xdist_group, loadgroup).
# Most tests wait on the protocol rather than compute, so more workers than the 2 cores pay:
# six workers and the `alone` tests after them ran the suite in 24:45 instead of 50 minutes
# (docs/development.md, "Parallel
# workers"). Tests that kill or restart a broker and time how the coordinator rides it out
# are marked `alone` and run after the workers, by themselves. WORKERS=0: one process.
WORKERS ?= 6
UNIT_WORKERS ?= 2
XDIST = -n $(1) --dist loadgroup

# Each step says how long it took; `make test` hands lint's and type-check's times to pytest,
# which prints them with the tiers' and the ten slowest tests at the end of the run
# (tests/support/report.py).
NOW_MS = $$(date +%s%3N)

lint: install
	$(PY) -m ruff check .

typecheck: install
	$(PY) -m mypy

# The Kafka jars (the local stack's brokers) and Spark's Kafka source jars, resolved once into
# ~/.cache/qlayer before the workers start, so no two of them fetch at once.
jars: install
	$(PY) -m tests.support.jars

unit: install jars
	$(PY) -m pytest tests/unit $(call XDIST,$(UNIT_WORKERS))

integration: install jars
	$(PY) -m pytest tests/integration $(call XDIST,$(WORKERS)) -m "not alone" && \
	$(PY) -m pytest tests/integration -m alone

acceptance: install browser jars
	$(PY) -m pytest tests/acceptance $(call XDIST,$(WORKERS))

# The quick tier, for every change (about 2 minutes): lint, type-check, and the unit tests with
# the Hypothesis machines and properties at a tenth of their examples (tests/support/examples.py).
check: install jars
	@t=$(NOW_MS); $(PY) -m ruff check . && l=$(NOW_MS) && $(PY) -m mypy && m=$(NOW_MS) && \
	QLAYER_HYPOTHESIS_PROFILE=check QLAYER_TIER_TIMES="lint $$((l - t)) typecheck $$((m - l))" \
	$(PY) -m pytest tests/unit $(call XDIST,$(UNIT_WORKERS)) --durations=10

# The whole suite: lint, type-check and every test with its full examples (CI runs this).
# Tests marked `alone` (the short fault soak: its canary may wait at most 1 s, its faults are
# timed; the broker outages and the journal made again after a broker restart) run after the
# parallel ones, by themselves: beside five busy workers on two cores the soak's shards counted
# its hostile records after more than a minute, and an outage test's coordinator loop was held
# up for most of a minute.
test: install browser jars
	@t=$(NOW_MS); $(PY) -m ruff check . && l=$(NOW_MS) && $(PY) -m mypy && m=$(NOW_MS) && \
	QLAYER_TIER_TIMES="lint $$((l - t)) typecheck $$((m - l))" \
	$(PY) -m pytest $(call XDIST,$(WORKERS)) -m "not alone" --durations=10 && \
	$(PY) -m pytest -m alone --durations=5

# Side by side with the raw Kafka relay and Kafka share groups on the local stack (quick,
# ~5 minutes; BENCH_FULL=1 for the full matrix; BENCH_ARGS="--bootstrap-servers ... --database-url
# ..." for another stack), then one backlog over several shards (benchmarks/credit_bench.py,
# ~8 minutes; CREDIT_ARGS="--before-tree DIR" to run its one-queue and 4-shard cells with an
# older checkout too), then exactly-once processing against at-least-once (benchmarks/tx_bench.py,
# ~4 minutes; TX_ARGS="--sizes 1,10" for other transaction sizes). Writes
# benchmarks/results/bench.json, credit.json, tx.json and docs/benchmarks.md.
bench: install
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	$(PY) benchmarks/credit_bench.py $(CREDIT_ARGS)
	$(PY) benchmarks/tx_bench.py $(TX_ARGS)
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
# SOAK_ARGS="--exactly-once --messages 20000" runs the exactly-once scenario instead (issue 34:
# transactional workers SIGKILLed at every point of their processing, one paused past its lease,
# the coordinator SIGKILLed; every result once, the audit balancing).
soak: install
	$(PY) -m tests.soak.run --output soak-result.json $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
