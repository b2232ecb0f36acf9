# WSGate: `make run` starts the gateway with the demo backend; `make test` runs every test.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format check render certs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/wsgate certs init
	$(BIN)/wsgate up

test: $(STAMP) lint
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

check: $(STAMP)
	$(BIN)/wsgate check policies

render: $(STAMP)
	$(BIN)/wsgate render

certs: $(STAMP)
	$(BIN)/wsgate certs init

clean:
	rm -rf run .pytest_cache .ruff_cache
