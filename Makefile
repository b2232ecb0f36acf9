# WSGate: `make run` starts the gateway with the demo backend; `make test` runs every test.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The compiled ext_proc frame (filters/frame: Rust, built by cargo through maturin). rustup puts cargo here.
FRAME := filters/frame
FRAME_STAMP := $(VENV)/.frame-installed
export PATH := $(HOME)/.cargo/bin:$(PATH)
# cargo test links the frame's tests against libpython (pyenv's is not on the loader's path).
PYLIB = $$($(CURDIR)/$(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')

.PHONY: run run-hsm test test-compose test-fast lint format check render certs clean bench soak load wss4j metro ratelimit jaeger

# xds-protos (the tests' Envoy config types) ships an older copy of opentelemetry-proto's modules in the same
# package path; whichever installs last wins. The tracer needs opentelemetry-proto's own: reinstalled last.
$(STAMP): pyproject.toml $(FRAME_STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --force-reinstall --no-deps "$$(grep -o 'opentelemetry-proto==[0-9.]*' pyproject.toml)"
	touch $(STAMP)

# Release build, pinned by Cargo.lock; rebuilt when the crate changes.
$(FRAME_STAMP): $(FRAME)/Cargo.toml $(FRAME)/Cargo.lock $(FRAME)/pyproject.toml $(FRAME)/wsgate_frame.pyi $(wildcard $(FRAME)/src/*.rs)
	@command -v cargo >/dev/null || { echo "cargo not found: the filter workers' frame needs a Rust toolchain (README)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(FRAME)
	touch $(FRAME_STAMP)

# The WSS4J interop harness (tests/interop/wss4j: Apache WSS4J 4.0.1, every version pinned in its pom.xml), one
# runnable jar; rebuilt when its sources change. The first build downloads from Maven Central into ~/.m2.
WSS4J := tests/interop/wss4j
WSS4J_JAR := $(WSS4J)/target/wss4j-harness.jar
$(WSS4J_JAR): $(WSS4J)/pom.xml $(wildcard $(WSS4J)/src/main/java/wsgate/interop/*.java)
	@command -v mvn >/dev/null || { echo "mvn not found: the WSS4J interop tests need Maven 3 and Java 17 (README)"; exit 1; }
	cd $(WSS4J) && mvn -q -B package
	touch $(WSS4J_JAR)

wss4j: $(WSS4J_JAR)

# The Metro interop client (tests/interop/metro: Eclipse Metro 4.0.4, pinned in its pom.xml), one runnable jar.
METRO := tests/interop/metro
METRO_JAR := $(METRO)/target/metro-client.jar
$(METRO_JAR): $(METRO)/pom.xml $(wildcard $(METRO)/src/main/java/wsgate/metro/*.java)
	@command -v mvn >/dev/null || { echo "mvn not found: the Metro interop tests need Maven 3 and Java 17 (README)"; exit 1; }
	cd $(METRO) && mvn -q -B package
	touch $(METRO_JAR)

metro: $(METRO_JAR)

# Go tools, each pinned by a small module (its go.mod names the version, its go.sum every module it needs), built
# from the Go module proxy into a cache directory (Go >= 1.21: it fetches the toolchain go.mod names; .ci/run
# provides one): the Envoy rate-limit service (quotas, docs/quotas.md; gateway/control/rate_limit.py looks for it
# at the same path) and Jaeger, the collector of the tracing tests (tests/support/collector.py).
export PATH := $(PATH):/usr/local/go/bin
GO_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/wsgate
go_version = $(shell sed -n 's|^require $(1) ||p' $(2)/go.mod)
define go_build
@command -v go >/dev/null || { echo "go not found: $@ is built with Go >= 1.21 (README)"; exit 1; }
cd $(1) && GOFLAGS=-mod=readonly go build -trimpath -o $@ $(2)
endef
RATELIMIT := gateway/tools/ratelimit
RATELIMIT_BIN := $(or $(WSGATE_RATELIMIT_BIN),$(GO_CACHE)/ratelimit-$(call go_version,github.com/envoyproxy/ratelimit,$(RATELIMIT))/ratelimit)
$(RATELIMIT_BIN): $(RATELIMIT)/go.mod $(RATELIMIT)/go.sum
	$(call go_build,$(RATELIMIT),github.com/envoyproxy/ratelimit/src/service_cmd)
JAEGER := tests/support/jaeger
JAEGER_BIN := $(GO_CACHE)/jaeger-$(call go_version,github.com/jaegertracing/jaeger,$(JAEGER))/jaeger
$(JAEGER_BIN): $(JAEGER)/go.mod $(JAEGER)/go.sum
	$(call go_build,$(JAEGER),github.com/jaegertracing/jaeger/cmd/jaeger)

ratelimit: $(RATELIMIT_BIN)
jaeger: $(JAEGER_BIN)

run: $(STAMP)
	$(BIN)/wsgate certs init
	$(BIN)/wsgate up

# The demo with the gateway's private keys in a SoftHSM2 token (docs/keys.md): certs/out/hsm.env names them.
run-hsm: $(STAMP)
	$(BIN)/wsgate certs init --hsm
	set -a && . certs/out/hsm.env && set +a && $(BIN)/wsgate up

test: $(STAMP) $(WSS4J_JAR) $(METRO_JAR) $(RATELIMIT_BIN) $(JAEGER_BIN) lint
	cd $(FRAME) && PYO3_PYTHON=$(CURDIR)/$(BIN)/python LD_LIBRARY_PATH=$(PYLIB) cargo test -q --release --locked
	$(BIN)/pytest -q

# The Compose stack for real (tests/e2e/test_compose_stack.py, docs/compose.md): stand-in base images, the build, the
# stack up, every profile, scaling, a killed replica, a policy roll, hardening. Needs a running Docker engine.
test-compose: $(STAMP)
	$(BIN)/pytest -q -s --compose tests/e2e/test_compose_stack.py

# Besides ruff and cargo: the frame/engine contract, the compiled frame against its stub (stubtest), the glue
# against the stub and the engine (mypy).
# The fast lane: tests/unit (the engine, the model, the tools in process; markers by folder, tests/conftest.py).
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "unit and not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the layers and no import circle: [tool.importlinter] in pyproject.toml
	$(BIN)/python -m mypy.stubtest wsgate_frame --allowlist $(FRAME)/stubtest-allowlist.txt
	$(BIN)/mypy filters/worker.py filters/engine
	cd $(FRAME) && cargo fmt --check
	cd $(FRAME) && PYO3_PYTHON=$(CURDIR)/$(BIN)/python cargo clippy -q --release --locked --all-targets -- -D warnings

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	cd $(FRAME) && cargo fmt

check: $(STAMP)
	$(BIN)/wsgate check policies

render: $(STAMP)
	$(BIN)/wsgate render

certs: $(STAMP)
	$(BIN)/wsgate certs init

clean:
	rm -rf run .pytest_cache .ruff_cache .mypy_cache $(FRAME)/target $(WSS4J)/target $(METRO)/target

# The benchmark: its own gateway on free ports, every profile x size; prints the tables, writes loadtest/out/.
# Needs Debian's wrk. BENCH_ARGS passes options, e.g. BENCH_ARGS="--profiles none,xml --sizes small".
bench: $(STAMP)
	$(BIN)/wsgate certs init
	$(BIN)/python -m loadtest.bench $(BENCH_ARGS)

# The soak: its own gateway, load at a share of saturation on every profile while faults strike (loadtest/soak.py);
# prints the table, writes loadtest/out/soak.csv and soak.png; fails when anything was lost, corrupted or replayed.
# SOAK_ARGS passes options, e.g. SOAK_ARGS="--duration 60 --seed 7 --share 0.5".
SOAK_ARGS ?= --duration 600
soak: $(STAMP)
	$(BIN)/wsgate certs init
	$(BIN)/python -m loadtest.soak $(SOAK_ARGS)

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
