#!/usr/bin/env bash
# Ingest benchmark: wrk posts ~1 KiB binary-mode CloudEvents with 64 connections to the bare
# hyper baseline (../shared/bench/baseline) and to sluice (durability "os" and "fsync"), in
# the same run, and prints req/s, p99 and the ratio to the baseline.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BASELINE_SRC=${BASELINE_SRC:-$ROOT/../shared/bench/baseline}
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

[ -d "$BASELINE_SRC" ] || { echo "baseline not found at $BASELINE_SRC" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is missing (make bench installs it)" >&2; exit 1; }

cargo build --release -q -p sluice-gateway
cargo build --release -q --manifest-path "$BASELINE_SRC/Cargo.toml" --target-dir "$ROOT/target/bench-baseline"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  for _ in $(seq 1 200); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2; return 1
}

# run_wrk NAME URL → prints "NAME req/s p99_ms non2xx"
run_wrk() {
  local out
  out=$(wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency -s tests/bench/post.lua "$2")
  local rps p99 bad
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us$/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v=v*1000}; print v}' <<<"$out")
  bad=$(awk '/Non-2xx/ {print $5}' <<<"$out")
  echo "$1 ${rps:-0} ${p99:-0} ${bad:-0}"
}

results=()
port=$(free_port)
"$ROOT/target/bench-baseline/release/baseline-ingest" "127.0.0.1:$port" 2>/dev/null &
pid=$!
wait_port "$port"
results+=("$(run_wrk baseline "http://127.0.0.1:$port/buses/default/events")")
kill $pid; wait $pid 2>/dev/null || true

for durability in os fsync; do
  port=$(free_port)
  SLUICE_DURABILITY=$durability SLUICE_LOG=warn "$ROOT/target/release/sluice" serve \
    --config sluice.example.toml --listen "127.0.0.1:$port" --data-dir "$WORK/data-$durability" &
  pid=$!
  wait_port "$port"
  results+=("$(run_wrk "sluice-$durability" "http://127.0.0.1:$port/buses/default/events")")
  kill -TERM $pid; wait $pid 2>/dev/null || true
  delivered=$(wc -l < "$WORK/data-$durability/delivered.jsonl" || echo 0)
  echo "sluice-$durability: $delivered events delivered to the file target during the run" >&2
done

base_rps=$(awk '{print $2}' <<<"${results[0]}")
printf '\n%-14s %12s %10s %10s %8s\n' target "req/s" "p99 ms" "non-2xx" ratio
for r in "${results[@]}"; do
  read -r name rps p99 bad <<<"$r"
  ratio=$(awk -v a="$rps" -v b="$base_rps" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
  printf '%-14s %12s %10s %10s %8s\n' "$name" "$rps" "$p99" "$bad" "$ratio"
done
echo
echo "goals: sluice-os >= 0.60 of baseline, sluice-fsync >= 0.30 (wrk -t1 -c$CONNECTIONS -d$DURATION, 1 KiB binary-mode events)"
