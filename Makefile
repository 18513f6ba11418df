# Sluice — the commands a developer and CI use. Everything a target needs that the machine
# lacks (cargo-nextest, the Python SDK for interop tests, wrk for benchmarks) is installed here.

SHELL := /bin/bash
CARGO ?= cargo
VENV := .venv
PYTHON := $(VENV)/bin/python
# Tools built from crates.io are kept outside the repository and reused.
CACHE ?= $(HOME)/.cache/sluice
APT_UPDATED := $(CACHE)/.apt-updated
# The RocketMQ name server and broker the end-to-end tests start, built once into the cache
# (optimised: on an unoptimised build the queue-count test misses the route refresh).
ROCKETMQ_DIR := $(CACHE)/rocketmq-1.0.0
ROCKETMQ_BENCH_DIR := $(CACHE)/rocketmq-1.0.0
export SLUICE_ROCKETMQ_BIN ?= $(ROCKETMQ_DIR)/bin

.PHONY: chaos webhook-node aws-node functions console-check run test lint fmt fuzz build bench bench-compare bench-ingest bench-functions bench-matching bench-cluster bench-targets bench-rules tools venv redis rocketmq rocketmq-bench infra-check infra-tools clean help

help:
	@echo "make run    - start the gateway standalone with sluice.example.toml (http://127.0.0.1:8080)"
	@echo "make test   - unit and end-to-end tests (cargo nextest)"
	@echo "make lint   - rustfmt check and clippy with warnings as errors"
	@echo "make fuzz   - every fuzz target for FUZZ_SECONDS (default 60) each (nightly, cargo-fuzz)"
	@echo "make bench  - ingest benchmark against the baseline, the functions benchmarks, and target throughput"
	@echo "make chaos  - the fault suite with every phase stretched (SLUICE_CHAOS=$(CHAOS)); reports in target/chaos-report.jsonl"
	@echo "make functions - build the example WebAssembly functions (examples/functions/) into target/functions/ and check them"
	@echo "make rocketmq - build the RocketMQ name server and broker for the tests (once, into the cache)"
	@echo "make infra-check - validate infra/ (Dockerfile, compose file, Kubernetes manifests); part of make test"
	@echo "make console-check - the web console in a real browser (Debian Chromium + playwright-core); part of make test"

run: build
	./target/debug/sluice serve --config sluice.example.toml

# The same package set as `make test` builds (features are resolved per build: building
# the gateway alone would compile part of the dependency tree again after `make test`).
build:
	$(CARGO) build --workspace --bins

# The binary is built for the same package set as nextest builds, so the dependencies are
# compiled once, with one feature set.
test: tools venv webhook-node aws-node redis rocketmq infra-tools
	$(MAKE) --no-print-directory build
	$(MAKE) --no-print-directory infra-check
	$(CARGO) nextest run --workspace --no-fail-fast
	$(MAKE) --no-print-directory console-check

# The fault suite (tests/tests/faults.rs) with every phase stretched: SLUICE_CHAOS=10 makes
# target outages 30 s, twenty replica kills, ten times the events. Every scenario's
# FAULT-REPORT line (events, faults, lost, duplicated, reordered, peak RSS) is collected in
# target/chaos-report.jsonl; RELIABILITY.md keeps the figures of a run. `make test` runs
# the same scenarios short.
CHAOS ?= 10
chaos: tools venv redis
	$(CARGO) build --workspace --bins
	mkdir -p target && rm -f target/chaos-report.jsonl
	SLUICE_CHAOS=$(CHAOS) SLUICE_FAULT_REPORT=$(CURDIR)/target/chaos-report.jsonl \
		$(CARGO) nextest run --workspace --no-fail-fast --test-threads 1 -E 'binary(faults)'
	@cat target/chaos-report.jsonl

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# cargo-fuzz (libFuzzer) on every target of both fuzz crates, FUZZ_SECONDS each; new
# corpus entries land in <crate>/fuzz/corpus/<target> (minimise with `cargo fuzz cmin`
# before committing). Needs the nightly toolchain; installs cargo-fuzz if missing.
# `make test` runs the same target bodies briefly on stable (gateway/tests/fuzz_corpora.rs).
FUZZ_SECONDS ?= 60
GATEWAY_FUZZ_TARGETS := ce_structured ce_batch ce_binary record_decode header_encode
FUNCTIONS_FUZZ_TARGETS := pattern_compile cesql_parse template
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || $(CARGO) install --locked cargo-fuzz
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@set -e; \
	for t in $(GATEWAY_FUZZ_TARGETS); do \
		echo "== gateway/fuzz $$t ($(FUZZ_SECONDS) s)"; \
		( cd gateway/fuzz && $(CARGO) +nightly fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) ); \
	done; \
	for t in $(FUNCTIONS_FUZZ_TARGETS); do \
		echo "== functions/fuzz $$t ($(FUZZ_SECONDS) s)"; \
		( cd functions/fuzz && $(CARGO) +nightly fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) ); \
	done

tools:
	@command -v cargo-nextest >/dev/null 2>&1 || $(CARGO) install --locked cargo-nextest

# Debian packages, installed only when missing (apt-get update once).
define apt_install
	@if ! command -v $(1) >/dev/null 2>&1; then \
		mkdir -p $(CACHE); \
		[ -f $(APT_UPDATED) ] || { apt-get update -qq && touch $(APT_UPDATED); }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2); \
	fi
endef

# redis-server for the distributed tests: tests that restart Redis start their own; the
# others use the one on 127.0.0.1:6379, started here when nothing answers there.
redis:
	$(call apt_install,redis-server,redis-server)
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no

# The official CloudEvents Python SDK, for the interoperability test.
venv: $(VENV)/.installed $(VENV)/.standardwebhooks $(VENV)/.webhook-sdks $(VENV)/.openapi $(VENV)/.aws

$(VENV)/.installed:
	$(call apt_install,python3,python3 python3-venv)
	@python3 -m venv $(VENV) 2>/dev/null || { rm -rf $(VENV); \
		mkdir -p $(CACHE); [ -f $(APT_UPDATED) ] || { apt-get update -qq && touch $(APT_UPDATED); }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv && python3 -m venv $(VENV); }
	$(PYTHON) -m pip install --quiet --disable-pip-version-check 'cloudevents==2.2.0'
	touch $@

# The Standard Webhooks reference package, to verify the HTTP target's signatures.
$(VENV)/.standardwebhooks: $(VENV)/.installed
	$(PYTHON) -m pip install --quiet --disable-pip-version-check 'standardwebhooks==1.1.0'
	touch $@

# Deployment files (infra/), validated without a Docker engine or a cluster: hadolint and
# checkov, every Kubernetes object against the Kubernetes, KEDA and Prometheus Operator
# schemas (strict), each kustomize overlay built and checked, the compose file's services
# and health checks, and every shipped Sluice configuration with `sluice check-config`.
# The tools (infra/checks/requirements.txt, PyPI only) go into their own virtualenv in the
# cache, installed once (about a minute); the checks take about 20 s.
INFRA_VENV := $(CACHE)/infra-venv
INFRA_PY := $(INFRA_VENV)/bin/python -B
INFRA_OUT := target/infra
SLUICE_BIN ?= target/debug/sluice

infra-tools: $(INFRA_VENV)/.installed

$(INFRA_VENV)/.installed: infra/checks/requirements.txt
	$(call apt_install,python3,python3 python3-venv)
	@python3 -m venv $(INFRA_VENV) 2>/dev/null || { rm -rf $(INFRA_VENV); \
		mkdir -p $(CACHE); [ -f $(APT_UPDATED) ] || { apt-get update -qq && touch $(APT_UPDATED); }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv && python3 -m venv $(INFRA_VENV); }
	$(INFRA_VENV)/bin/pip install --quiet --disable-pip-version-check -r infra/checks/requirements.txt
	touch $@

# checkov runs with --skip-download: it asks no service for policies or guidelines.
infra-check: infra-tools
	@[ -x $(SLUICE_BIN) ] || $(CARGO) build --workspace --bins
	$(INFRA_VENV)/bin/hadolint infra/Dockerfile
	$(INFRA_PY) infra/checks/check_dockerfile.py $(SLUICE_BIN)
	$(INFRA_PY) infra/checks/check_compose.py $(SLUICE_BIN)
	$(INFRA_PY) infra/checks/check_k8s.py $(SLUICE_BIN) $(INFRA_VENV)/bin/kubectl $(INFRA_OUT)
	$(INFRA_VENV)/bin/checkov --quiet --compact --skip-download --framework kubernetes -d $(INFRA_OUT)
	$(INFRA_VENV)/bin/checkov --quiet --compact --skip-download --framework dockerfile -f infra/Dockerfile

# The providers' own signing code for the webhook tests: Stripe's test-header helper and
# slack_sdk's SignatureVerifier.
$(VENV)/.webhook-sdks: $(VENV)/.installed
	$(PYTHON) -m pip install --quiet --disable-pip-version-check 'stripe==16.1.0' 'slack_sdk==3.48.0'
	touch $@

# GitHub's own signing code for the webhook tests (@octokit/webhooks-methods from npm, into
# the cache); tests/scripts/sign_webhook.py runs it with node.
WEBHOOK_NODE := $(CACHE)/webhook-node
export WEBHOOK_NODE_DIR ?= $(WEBHOOK_NODE)
webhook-node:
	$(call apt_install,npm,npm)
	@mkdir -p $(WEBHOOK_NODE) && cd $(WEBHOOK_NODE) && { [ -d node_modules/@octokit/webhooks-methods ] || npm install --silent --no-audit --no-fund @octokit/webhooks-methods@6.0.0; }

# The example functions (examples/functions, docs/functions.md): componentize-js and jco
# (npm, into the cache, at the versions examples/functions/js/package.json pins) build
# enrich.js and split-order.js into WebAssembly components in target/functions/ (about
# 12 MB each, seconds each), and check.mjs calls them from node without the gateway, every
# import a stub that throws. Where the wasm32-wasip2 target is installed the Rust example
# is built (its own workspace and target/) and checked too, into
# target/functions/country-lookup.wasm.
FUNCTIONS_NODE := $(CACHE)/functions-node
FUNCTIONS_OUT := target/functions
functions:
	$(call apt_install,npm,npm)
	@mkdir -p $(FUNCTIONS_NODE) && { cmp -s examples/functions/js/package.json $(FUNCTIONS_NODE)/.installed || { \
		cp examples/functions/js/package.json $(FUNCTIONS_NODE)/package.json && \
		(cd $(FUNCTIONS_NODE) && npm install --silent --no-audit --no-fund) && \
		cp examples/functions/js/package.json $(FUNCTIONS_NODE)/.installed; }; }
	FUNCTIONS_NODE_DIR=$(FUNCTIONS_NODE) node examples/functions/js/build.mjs $(FUNCTIONS_OUT)
	FUNCTIONS_NODE_DIR=$(FUNCTIONS_NODE) node examples/functions/js/check.mjs $(FUNCTIONS_OUT)
	@if rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then \
		(cd examples/functions/rust && $(CARGO) build --release --target wasm32-wasip2) && \
		cp examples/functions/rust/target/wasm32-wasip2/release/country_lookup.wasm $(FUNCTIONS_OUT)/country-lookup.wasm && \
		FUNCTIONS_NODE_DIR=$(FUNCTIONS_NODE) node examples/functions/rust/check.mjs $(FUNCTIONS_OUT)/country-lookup.wasm; \
	else echo "wasm32-wasip2 is not installed (rustup target add wasm32-wasip2): the Rust example is not built"; fi

# The AWS SDK for Python, for the EventBridge PutEvents tests (tests/tests/compat_aws.rs).
$(VENV)/.aws: $(VENV)/.installed
	$(PYTHON) -m pip install --quiet --disable-pip-version-check 'boto3==1.44.18'
	touch $@

# The AWS SDK for JavaScript's EventBridge client (npm, into the cache) for the same tests;
# tests/scripts/aws_put_events.mjs runs it with node.
AWS_NODE := $(CACHE)/aws-node
export AWS_NODE_DIR ?= $(AWS_NODE)
aws-node:
	$(call apt_install,npm,npm)
	@mkdir -p $(AWS_NODE) && cd $(AWS_NODE) && { [ -d node_modules/@aws-sdk/client-eventbridge ] || npm install --silent --no-audit --no-fund @aws-sdk/client-eventbridge@3.1178.0; }

# The OpenAPI 3.1 validator and JSON Schema, to check schemas/openapi.json and the admin
# API's answers against it.
$(VENV)/.openapi: $(VENV)/.installed tests/scripts/requirements-openapi.txt
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r tests/scripts/requirements-openapi.txt
	touch $@

# The web console in a real browser: playwright-core (npm, into the cache) driving Debian's
# Chromium against two gateways in distributed mode (the machine's Redis, a prefix of their
# own, each replica with its own port and scratch data directory; member and lease TTL 3 s),
# so the test can kill the second one and watch its tasks move. Installs what is missing
# (Chromium, npm, playwright-core); screenshots go to target/console-screenshots/. The
# gateways, the temporary directory and the Redis keys are removed however it ends.
CONSOLE_TOOLS := $(CACHE)/console
CONSOLE_SHOTS := target/console-screenshots
console-check: redis
	$(CARGO) build --workspace --bins
	$(call apt_install,chromium,chromium)
	$(call apt_install,npm,npm)
	@mkdir -p $(CONSOLE_TOOLS) && cd $(CONSOLE_TOOLS) && { [ -d node_modules/playwright-core ] || npm install --silent --no-audit --no-fund playwright-core@1; }
	@mkdir -p $(CONSOLE_SHOTS) && rm -f $(CONSOLE_SHOTS)/console-*.png; \
	tmp=$$(mktemp -d); pids=""; prefix="sluice-console-$$$$-$$(date +%s)"; \
	mine() { grep -qsF "$$tmp/sluice.toml" /proc/$$1/cmdline; }; \
	cleanup() { \
		for p in $$pids; do mine $$p && kill $$p; done; \
		for p in $$pids; do for t in $$(seq 50); do mine $$p || break; sleep 0.1; done; mine $$p && kill -9 $$p; done; \
		redis-cli -h 127.0.0.1 -p 6379 --scan --pattern "$$prefix:*" | xargs -r -n 500 redis-cli -h 127.0.0.1 -p 6379 del >/dev/null; \
		rm -rf "$$tmp"; \
	}; \
	trap cleanup EXIT; trap 'exit 130' INT TERM; \
	free_port() { while :; do p=$$((20000 + RANDOM % 20000)); (exec 3<>/dev/tcp/127.0.0.1/$$p) 2>/dev/null || { echo $$p; return; }; done; }; \
	port1=$$(free_port); port2=$$(free_port); while [ $$port2 = $$port1 ]; do port2=$$(free_port); done; \
	printf '%s\n' 'mode = "distributed"' 'redis_url = "redis://127.0.0.1:6379/"' "redis_prefix = \"$$prefix\"" \
		'durability = "os"' 'log = "warn"' '[admin]' 'allow_local_without_token = true' \
		'[cluster]' 'member_ttl = "3s"' 'lease_ttl = "3s"' \
		'[[buses]]' 'name = "default"' 'shards = 2' \
		'[[rules]]' 'name = "all-events"' 'bus = "default"' \
		'[[rules.targets]]' 'type = "file"' 'name = "delivered"' 'path = "{data_dir}/delivered.jsonl"' \
		'[[webhooks]]' 'name = "console-hook"' 'bus = "default"' 'verify = { preset = "none" }' > $$tmp/sluice.toml; \
	for i in 1 2; do \
		port=$$([ $$i = 1 ] && echo $$port1 || echo $$port2); mkdir -p $$tmp/data-$$i; \
		( ./target/debug/sluice serve --config $$tmp/sluice.toml --data-dir $$tmp/data-$$i --listen 127.0.0.1:$$port >$$tmp/gateway-$$i.log 2>&1 & echo $$! >$$tmp/pid-$$i ); \
		pid=$$(cat $$tmp/pid-$$i); pids="$$pids $$pid"; eval "pid$$i=$$pid"; \
		for t in $$(seq 100); do curl -sf http://127.0.0.1:$$port/readyz >/dev/null && break; sleep 0.1; done; \
		curl -sf http://127.0.0.1:$$port/readyz >/dev/null || { echo "gateway $$i did not start:"; cat $$tmp/gateway-$$i.log; exit 1; }; \
	done; \
	start=$$(date +%s); \
	( cd $(CONSOLE_TOOLS) && node $(CURDIR)/tests/console/smoke.mjs http://127.0.0.1:$$port1 http://127.0.0.1:$$port2 $$pid2 $(CURDIR)/$(CONSOLE_SHOTS) ); rc=$$?; \
	echo "console-check: $$([ $$rc = 0 ] && echo passed || echo FAILED) in $$(( $$(date +%s) - start )) s (browser run); screenshots in $(CONSOLE_SHOTS)/"; \
	if [ $$rc != 0 ]; then for i in 1 2; do echo "--- gateway $$i (last lines)"; tail -n 30 $$tmp/gateway-$$i.log; done; fi; \
	exit $$rc

# rocketmq-namesrv-rust and rocketmq-broker-rust, into the cache, only when missing: for the
# tests unoptimised (`--debug`, no debug info), for the benchmark optimised.
rocketmq:
	@if [ ! -x $(ROCKETMQ_DIR)/bin/rocketmq-namesrv-rust ] || [ ! -x $(ROCKETMQ_DIR)/bin/rocketmq-broker-rust ]; then \
		echo "building the RocketMQ name server and broker for the tests into $(ROCKETMQ_DIR) (about 30 minutes)"; \
		$(CARGO) install --locked --root $(ROCKETMQ_DIR) rocketmq-namesrv@1.0.0 rocketmq-broker@1.0.0; \
	fi

rocketmq-bench:
	@if [ ! -x $(ROCKETMQ_BENCH_DIR)/bin/rocketmq-namesrv-rust ] || [ ! -x $(ROCKETMQ_BENCH_DIR)/bin/rocketmq-broker-rust ]; then \
		echo "building an optimised RocketMQ name server and broker into $(ROCKETMQ_BENCH_DIR) (about 30 minutes)"; \
		$(CARGO) install --locked --root $(ROCKETMQ_BENCH_DIR) rocketmq-namesrv@1.0.0 rocketmq-broker@1.0.0; \
	fi

# Every benchmark, then the figures gathered into target/bench/summary.json and compared
# with the committed previous run (tests/bench/summary.json): what moved by more than 10 %.
bench: bench-ingest bench-functions bench-matching bench-cluster bench-targets bench-rules
	tests/bench/summary.py

# The comparison alone, after one or more bench-* targets.
bench-compare:
	tests/bench/summary.py

# End-to-end events/s into RocketMQ and into an HTTP receiver, against each peer's own capacity.
bench-targets: rocketmq-bench
	SLUICE_ROCKETMQ_BIN=$(ROCKETMQ_BENCH_DIR)/bin tests/bench/targets.sh

bench-ingest:
	$(call apt_install,wrk,wrk)
	@command -v inferno-flamegraph >/dev/null || $(CARGO) install --locked inferno || echo "inferno could not be installed: flame graphs stay folded stacks"
	tests/bench/ingest.sh
	tests/bench/compat.sh

# WebAssembly functions: delivered events/s through no step, a TEMPLATE step, a no-op and a
# JSON-editing WebAssembly step, and the JavaScript example (built by `make functions`).
bench-functions: functions
	$(CARGO) build --release -p sluice-gateway -p sluice-tests --bin sluice --bin functions-bench
	FUNCTIONS_JS=$(FUNCTIONS_OUT)/enrich.wasm ./target/release/functions-bench

# Pattern, CESQL and transform costs in the functions crate (criterion).
bench-matching:
	$(CARGO) bench -p sluice-functions

clean:
	$(CARGO) clean
	rm -rf $(VENV) data

# Takeover and convergence times, and events/s with 1, 2 and 3 replicas (distributed mode,
# the machine's Redis).
bench-cluster: redis
	$(CARGO) build --release -p sluice-gateway -p sluice-tests --bin sluice --bin cluster-bench
	./target/release/cluster-bench

# Fan-out: delivered events/s, start-up, RSS, idle CPU and idle Redis commands with 1, 100,
# 1,000 and 10,000 rules on one bus, standalone and distributed (the machine's Redis).
bench-rules: redis
	$(CARGO) build --release -p sluice-gateway -p sluice-tests --bin sluice --bin rules-bench
	./target/release/rules-bench
