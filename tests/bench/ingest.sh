#!/usr/bin/env bash
# Ingest benchmark: wrk posts ~1 KiB binary-mode CloudEvents with 64 connections to the bare
# hyper baseline (../shared/bench/baseline) and to sluice (durability "os" and "fsync"), in
# the same run, and prints req/s, p99 and the ratio to the baseline. Then the overhead of
# observability: sluice "os" with span export over OTLP (to a second baseline process as the
# collector) against sluice "os" without, interleaved (os, os+otlp, os, os+otlp), and the
# share of the gateway's CPU per request that metrics take (metrics-cost's ns per event over
# the CPU time sluice spent per request under load). RSS idle and peak under load too.
# And verified webhook ingest (GitHub preset: HMAC-SHA256 checked, delivery id deduplicated)
# against plain CloudEvents ingest on the same bus (goal >= 0.8).
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

cargo build --release -q -p sluice-gateway -p sluice-tests --bin sluice --bin metrics-cost
cargo build --release -q --manifest-path "$BASELINE_SRC/Cargo.toml" --target-dir "$ROOT/target/bench-baseline"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  for _ in $(seq 1 200); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2; return 1
}

# run_wrk NAME URL [SCRIPT] → prints "NAME req/s p99_ms non2xx"
run_wrk() {
  local out
  out=$(wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency -s "${3:-tests/bench/post.lua}" "$2")
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

# cpu_ticks PID → utime + stime of the process, in clock ticks
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# rss_kib PID FIELD → VmRSS or VmHWM in KiB
rss_kib() { awk -v f="$2:" '$1==f {print $2}' "/proc/$1/status"; }

# run_sluice NAME DURABILITY [EXTRA_TOML [PATH SCRIPT]] → appends to results, prints
# CPU/RSS to stderr
cpu_per_req_us=""
run_sluice() {
  local name=$1 durability=$2 extra=${3:-} path=${4:-/buses/default/events} script=${5:-tests/bench/post.lua}
  local port config before after idle_rss peak_rss row rps
  port=$(free_port)
  config="$WORK/$name.toml"
  { cat sluice.example.toml; printf '\n%s\n' "$extra"; } > "$config"
  rm -rf "$WORK/data-$name"
  SLUICE_DURABILITY=$durability SLUICE_LOG=warn "$ROOT/target/release/sluice" serve \
    --config "$config" --listen "127.0.0.1:$port" --data-dir "$WORK/data-$name" &
  pid=$!
  wait_port "$port"
  sleep 0.5
  idle_rss=$(rss_kib $pid VmRSS)
  before=$(cpu_ticks $pid)
  row=$(run_wrk "$name" "http://127.0.0.1:$port$path" "$script")
  after=$(cpu_ticks $pid)
  peak_rss=$(rss_kib $pid VmHWM)
  results+=("$row")
  kill -TERM $pid; wait $pid 2>/dev/null || true
  rps=$(awk '{print $2}' <<<"$row")
  delivered=$(wc -l < "$WORK/data-$name/delivered.jsonl" || echo 0)
  local secs=${DURATION%s}
  local us
  us=$(awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v r="$rps" -v d="$secs" \
    'BEGIN { printf "%.1f", (r > 0 ? t / hz / (r * d) * 1e6 : 0) }')
  [ "$name" = sluice-os ] && cpu_per_req_us=$us
  echo "$name: $delivered events delivered during the run; CPU ${us} us per request; RSS idle $((idle_rss / 1024)) MiB, peak $((peak_rss / 1024)) MiB" >&2
}

run_sluice sluice-os os
run_sluice sluice-fsync fsync

# The collector for OTLP export: a second baseline process (answers 202 to every POST).
otlp_port=$(free_port)
"$ROOT/target/bench-baseline/release/baseline-ingest" "127.0.0.1:$otlp_port" 2>/dev/null &
otlp_pid=$!
wait_port "$otlp_port"
otlp="[tracing]
otlp_endpoint = \"http://127.0.0.1:$otlp_port\""
run_sluice sluice-os-otlp os "$otlp"
run_sluice sluice-os os
run_sluice sluice-os-otlp os "$otlp"
run_sluice sluice-os-otlp10 os "$otlp
sample_ratio = 0.1"
kill $otlp_pid; wait $otlp_pid 2>/dev/null || true

# Verified webhooks on the same bus (the data post.lua sends, signed once; each request has
# its own delivery id, so every one is verified and deduplicated).
body=$(cat tests/bench/event-data.json)
export WEBHOOK_SIGNATURE="sha256=$(printf '%s' "$body" | openssl dgst -sha256 -hmac bench-secret -r | cut -d' ' -f1)"
hook='[[webhooks]]
name = "github"
bus = "default"
verify = { preset = "github", secret = "bench-secret" }'
run_sluice sluice-os-webhook os "$hook" /webhooks/github tests/bench/webhook.lua

base_rps=$(awk '{print $2}' <<<"${results[0]}")
printf '\n%-15s %12s %10s %10s %8s\n' target "req/s" "p99 ms" "non-2xx" ratio
for r in "${results[@]}"; do
  read -r name rps p99 bad <<<"$r"
  ratio=$(awk -v a="$rps" -v b="$base_rps" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
  printf '%-15s %12s %10s %10s %8s\n' "$name" "$rps" "$p99" "$bad" "$ratio"
done
mean() { printf '%s\n' "${results[@]}" | awk -v n="$1" '$1==n {s+=$2; c++} END {printf "%.0f", (c ? s/c : 0)}'; }
os_mean=$(mean sluice-os)
otlp_mean=$(mean sluice-os-otlp)
metrics_ns=$("$ROOT/target/release/metrics-cost")
webhook_mean=$(mean sluice-os-webhook)
echo
awk -v a="$webhook_mean" -v b="$os_mean" 'BEGIN { printf "verified webhooks (github preset, dedup): %.0f req/s vs %.0f plain CloudEvents: %.2f (goal >= 0.80)\n", a, b, (b > 0 ? a / b : 0) }'
awk -v a="$otlp_mean" -v b="$os_mean" 'BEGIN { printf "tracing (OTLP export of every trace): %.0f req/s vs %.0f without: overhead %.1f %% (goal < 5 %%)\n", a, b, (b > 0 ? (1 - a / b) * 100 : 0) }'
awk -v a="$(mean sluice-os-otlp10)" -v b="$os_mean" 'BEGIN { printf "tracing (OTLP export, sample_ratio = 0.1): %.0f req/s: overhead %.1f %%\n", a, (b > 0 ? (1 - a / b) * 100 : 0) }'
awk -v ns="$metrics_ns" -v us="$cpu_per_req_us" 'BEGIN { printf "metrics: %d ns per event of %.1f us CPU per request: overhead %.2f %% (goal < 5 %%)\n", ns, us, (us > 0 ? ns / (us * 1000) * 100 : 0) }'
echo
echo "goals: sluice-os >= 0.60 of baseline, sluice-fsync >= 0.30 (wrk -t1 -c$CONNECTIONS -d$DURATION, 1 KiB binary-mode events)"
