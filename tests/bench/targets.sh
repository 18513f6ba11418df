#!/usr/bin/env bash
# End-to-end target throughput: into RocketMQ and into an HTTP receiver, each as a share of
# the peer's own capacity measured in the same run. Needs an optimised broker, `make rocketmq-bench`
# (the Makefile's bench-targets target builds it and runs this). SLUICE_BENCH_EVENTS sets the event count
# of each phase (default 50000: a phase of a second or more, so start-up weighs little).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p sluice-gateway
cargo test --release -p sluice-tests --test bench_targets -- --ignored --nocapture 2>&1 | grep -E '^BENCH|panicked|error' 
