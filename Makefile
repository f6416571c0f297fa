# Set-up and checks. `make run` and `make test` work on a fresh machine: both
# create the virtual environment and install the project first; `make test` also installs
# the Debian packages its tests run for real (chromium, the PostgreSQL 15 server) when missing,
# which needs root or password-less sudo. `make run` needs no system package. `make postgres`
# runs PostgreSQL with pgvector (the pinned wheel the tests use) on 127.0.0.1 until Ctrl-C.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install system-deps run postgres test lint typecheck proto-check docs docs-check gen bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,semantic]'
	touch $(STAMP)

install: $(STAMP)

system-deps:
	@scripts/system-deps.sh

run: install
	$(BIN)/arona-gateway up

# PGPORT=5433 make postgres for another port; --dir: .venv/bin/python -m arona_store.pg.local -h
postgres: install
	$(BIN)/python -m arona_store.pg.local

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

proto-check: install
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code

# The docs site (docs/, mkdocs.yml) into site/; strict: a broken link or anchor, or a page left
# out of the navigation, fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-check: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"

test: system-deps lint typecheck proto-check docs-check
	$(BIN)/pytest

gen: install
	$(BIN)/python scripts/gen_protos.py

# LiteLLM (the peer) goes into a venv of its own so its pins cannot change the gateway's
# packages; if it cannot be installed, the benchmark says so and measures the rest.
BENCH_VENV := bench/.venv
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	-$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[dev,bench]' && touch $(BENCH_STAMP)

bench: install $(BENCH_STAMP)
	$(BIN)/python -m bench --litellm $(BENCH_VENV)/bin/litellm

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
