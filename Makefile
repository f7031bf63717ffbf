# The two commands a newcomer types (README.md): `make run` and `make test`.
# Both create .venv and install what they need; `make test` also makes sure a
# PostgreSQL server answers (see scripts/ensure-postgres.sh).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Embedded PostgreSQL and the local object store live here unless configured. It is
# also what inboxd itself defaults to in a source checkout, so `inboxd status` typed
# in a shell (without this variable) reaches the server `make run` started.
export INBOXD_DATA_DIR ?= $(CURDIR)/var
# initdb refuses to run as root; the embedded server then runs as this existing
# unprivileged user (never created by inboxd). See daemon/embedded_pg/run_as.py.
ifeq ($(shell id -u),0)
export INBOXD_EMBEDDED_PG_USER ?= nobody
endif
CORPUS ?= $(CURDIR)/tests/corpus/mime
# The demo tenant's API token (config.example.tenants/demo.toml api_token): the daemon
# of `make run` listens on 127.0.0.1 only. `make run DEMO_TOKEN=…` for another.
DEMO_TOKEN ?= demo-loopback-token
export INBOXD_DEMO_TOKEN ?= $(DEMO_TOKEN)
# `make test` and `make test-fast` run the suite on this many pytest-xdist worker
# processes (TEST_WORKERS=0: all in pytest's own process). Most slow tests wait on a
# subprocess daemon, so more workers than the 2 cores of a CI runner pay; see the
# commit that set the number for the measurements. --dist loadgroup keeps the tests of
# one group on one worker, one after another (tests/bench: two groups of CPU-bound
# runs), and tests/helpers/xdist_groups.py hands the known-long tests out first.
# pytest run by hand stays in one process: starting workers costs more than one file.
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: run import-demo test test-fast check lint typecheck bench bench-smoke venv venv-test clean

# What running needs (make run, make import-demo): inboxd and its dependencies only.
$(BIN)/inboxd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

# What testing and the quality gates add (pytest, moto, ruff, mypy, …).
$(VENV)/.test-tools: $(BIN)/inboxd pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/inboxd
venv-test: $(VENV)/.test-tools

# The main job: the daemon with config.example.toml, on the embedded PostgreSQL
# (unless INBOXD_DSN is set), a local object store in ./var/objects and a Maildir
# door in ./var/maildir/demo: drop a message into its new/ and it becomes rows.
run: venv
	@mkdir -p $(INBOXD_DATA_DIR) && chmod 0755 $(INBOXD_DATA_DIR)
	$(BIN)/inboxd check-config config.example.toml
	$(BIN)/inboxd run --config config.example.toml --log-level info

# One-shot import of a mail folder (default: the test corpus, tests/corpus/mime) into the
# demo tenant's configured mailbox "local" (config.example.tenants/demo.toml).
import-demo: venv
	@mkdir -p $(INBOXD_DATA_DIR) && chmod 0755 $(INBOXD_DATA_DIR)
	$(BIN)/inboxd import --config config.example.toml --tenant demo --mailbox local $(CORPUS)

# The whole suite, after the quality gates (CI runs exactly this).
test: check
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-dovecot.sh
	$(BIN)/python -m pytest -q $(XDIST)

# The suite without the tests marked slow (subprocess daemons, benchmarks at tiny size).
test-fast: venv-test
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-dovecot.sh
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

# Quality gates: lint, formatting, types (mypy settings in pyproject.toml).
check: lint typecheck
	$(BIN)/ruff format --check .

lint: venv-test
	$(BIN)/ruff check .

typecheck: venv-test
	bash scripts/typecheck.sh $(BIN)/python

bench: venv-test
	$(BIN)/python bench/ingest.py

# Every benchmark at a tiny size, so none rots unnoticed (also a slow test).
bench-smoke: venv-test
	bash scripts/ensure-postgres.sh
	$(BIN)/python -m pytest -q tests/bench

# Stop the embedded server first: a postmaster whose directory is deleted under it
# keeps running (and holding its memory and socket) until the machine reboots.
clean:
	@if [ -x $(BIN)/inboxd ]; then $(BIN)/inboxd db stop; fi
	rm -rf $(VENV) var
