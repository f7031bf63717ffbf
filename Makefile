# The two commands a newcomer types (README.md): `make run` and `make test`.
# Both create .venv and install what they need; `make test` also makes sure a
# PostgreSQL server answers (see scripts/ensure-postgres.sh).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Embedded PostgreSQL and the local object store live here unless configured.
export INBOXD_DATA_DIR ?= $(CURDIR)/var
# initdb refuses to run as root; the embedded server then runs as this existing
# unprivileged user (never created by inboxd). See daemon/pg_cluster.py.
ifeq ($(shell id -u),0)
export INBOXD_EMBEDDED_PG_USER ?= nobody
endif
CORPUS ?= $(CURDIR)/../shared/corpus/mime

.PHONY: run import-demo test lint bench venv clean

$(BIN)/inboxd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/inboxd

# The main job: the daemon with config.example.toml, on the embedded PostgreSQL
# (unless INBOXD_DSN is set), a local object store in ./var/objects and a Maildir
# door in ./var/maildir/demo: drop a message into its new/ and it becomes rows.
run: venv
	@mkdir -p $(INBOXD_DATA_DIR) && chmod 0755 $(INBOXD_DATA_DIR)
	$(BIN)/inboxd check-config config.example.toml
	$(BIN)/inboxd run --config config.example.toml --log-level info

# One-shot import of a mail folder (default: the shared corpus) into tenant "demo".
import-demo: venv
	@mkdir -p $(INBOXD_DATA_DIR) && chmod 0755 $(INBOXD_DATA_DIR)
	$(BIN)/inboxd import --config config.example.toml --tenant demo --mailbox corpus $(CORPUS)

test: venv
	bash scripts/ensure-postgres.sh
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) var
