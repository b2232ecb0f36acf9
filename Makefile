# WSGate: `make run` starts the gateway with the demo backend; `make test` runs every test.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format check render certs clean bench load

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

# The benchmark: its own gateway on free ports, every profile x size; prints the tables, writes loadtest/out/.
# Needs Debian's wrk. BENCH_ARGS passes options, e.g. BENCH_ARGS="--profiles none,xml --sizes small".
bench: $(STAMP)
	$(BIN)/wsgate certs init
	$(BIN)/python -m loadtest.bench $(BENCH_ARGS)

# Locust, headless, against a running gateway (`make run`) or any URL; CSV and HTML report in loadtest/out/.
# SIZE: small, large, huge (comma-separated); PROFILES: user classes, e.g. PROFILES="HmacUser RsaUser".
URL ?= http://127.0.0.1:8080
USERS ?= 20
TIME ?= 30s
SIZE ?= small
PROFILES ?=
load: $(STAMP)
	mkdir -p loadtest/out
	LOAD_SIZE=$(SIZE) $(BIN)/locust -f loadtest/locustfile.py --headless --host $(URL) -u $(USERS) -r $(USERS) \
		-t $(TIME) --csv loadtest/out/locust --html loadtest/out/locust.html $(PROFILES)
