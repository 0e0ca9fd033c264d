# kmq-tracker developer commands. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml setup.py tracker/_speedups.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pipeline.jvm_jar --if-possible
	touch $@

.PHONY: install
install: $(VENV)/.installed ## Create .venv and install the project with its dev extras

.PHONY: postgres
postgres: ## Start the local PostgreSQL server if it is down (used by the tests)
	@scripts/ensure-postgres.sh

.PHONY: lint
lint: install ## ruff (lint + format check), mypy (strict) and the layering contracts (lint-imports)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

.PHONY: browser
browser: ## Install Chromium + chromedriver if missing (the console's browser tests need them)
	@scripts/ensure-browser.sh

.PHONY: jdk
jdk: ## Install a JDK compiler if missing (the pipeline's JVM marker decoder is compiled with javac)
	@scripts/ensure-jdk.sh

.PHONY: test
test: jdk install postgres browser lint ## The one test command: lint, type checks, unit, integration and browser tests
	KMQ_REQUIRE_SPEEDUPS=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

.PHONY: console-screenshots
console-screenshots: install browser ## Refresh docs/console/*.png from the console's browser test
	KMQ_CONSOLE_SCREENSHOTS=docs/console $(VENV)/bin/pytest tests/browser -q -p no:cacheprovider

.PHONY: soak
soak: install postgres ## Long reliability runs (KMQ_SOAK=1); figures appended to build/reliability/
	KMQ_SOAK=1 KMQ_REQUIRE_SPEEDUPS=1 \
	KMQ_RELIABILITY_FIGURES=build/reliability/soak-figures.jsonl \
	$(VENV)/bin/pytest tests/reliability --timeout=1800 -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: demo
demo: install ## Run a local broker, the tracker (SQLite) and a demo workload; Ctrl-C stops
	$(VENV)/bin/kmq-tracker demo

.PHONY: run
run: install ## Run the tracker with settings from the environment (KMQ_*) / KMQ_CONFIG_FILE
	$(VENV)/bin/kmq-tracker run

.PHONY: unit
unit: install ## Unit tests only (no broker, no database)
	$(VENV)/bin/pytest -m unit $(PYTEST_ARGS)

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $@

.PHONY: bench
bench: $(VENV)/.bench-installed postgres ## Benchmarks (~25 min): bench/results/<date>.json, docs/benchmarks.md
	$(PY) -m bench $(BENCH_ARGS)

.PHONY: bench-smoke
bench-smoke: install postgres ## Every benchmark scenario with tiny sizes (the test-suite check)
	$(VENV)/bin/pytest tests/bench -q $(PYTEST_ARGS)

.PHONY: format
format: install ## Reformat the code with ruff
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

.PHONY: clean
clean: ## Remove the venv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
