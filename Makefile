# The two commands a newcomer types (README.md): `make run` and `make test`.
# Both create .venv and install what they need; `make test` also makes sure a
# PostgreSQL server answers (see scripts/ensure-postgres.sh).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Embedded PostgreSQL and the local object store live here unless configured.
export INBOXD_DATA_DIR ?= $(CURDIR)/var
# initdb refuses to run as root; the embedded server then runs as this existing
# unprivileged user (never created by inboxd). See daemon/embedded_pg.py.
ifeq ($(shell id -u),0)
export INBOXD_EMBEDDED_PG_USER ?= nobody
endif
CORPUS ?= $(CURDIR)/../shared/corpus/mime

.PHONY: run test lint bench venv clean

$(BIN)/inboxd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/inboxd

# The main job: apply the schema and import a mail folder (default: the shared
# corpus) into tenant "demo", on the embedded PostgreSQL unless INBOXD_DSN is set.
run: venv
	@mkdir -p $(INBOXD_DATA_DIR) && chmod 0755 $(INBOXD_DATA_DIR)
	$(BIN)/inboxd migrate
	$(BIN)/inboxd import --tenant demo --mailbox corpus $(CORPUS)

test: venv
	bash scripts/ensure-postgres.sh
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) var
