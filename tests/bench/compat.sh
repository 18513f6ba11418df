#!/usr/bin/env bash
# Drop-in API ingest: the same 10 events per request (~1 KiB each, event-data.json) posted
# by wrk as a CloudEvents batch (POST /buses/default/events), as AWS EventBridge PutEvents
# with 10 entries (POST /, X-Amz-Target: AWSEvents.PutEvents), and as a RocketMQ
# EventBridge batch (POST /putEvents), each against a fresh gateway (durability "os", the
# sample configuration), interleaved twice in one run; prints events/s and each API's
# ratio to the CloudEvents batch (goal >= 0.90).
#
#   DURATION=10s CONNECTIONS=64 ROUNDS=2 tests/bench/compat.sh
#   SLUICE_BIN=target/debug/sluice DURATION=2s ROUNDS=1 tests/bench/compat.sh   # smoke run
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
ROUNDS=${ROUNDS:-2}
WORK=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$WORK"' EXIT

command -v wrk >/dev/null || { echo "wrk is missing (make bench-ingest installs it)" >&2; exit 1; }
BIN=${SLUICE_BIN:-}
unset SLUICE_BIN
if [ -z "$BIN" ]; then
  cargo build --release -q -p sluice-gateway --bin sluice
  BIN=$ROOT/target/release/sluice
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 200); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2; return 1
}

results=()
# run MODE PATH → appends "MODE events/s refused" to results
run() {
  local mode=$1 path=$2 port out rps refused
  port=$(free_port)
  rm -rf "$WORK/data"
  SLUICE_DURABILITY=os SLUICE_LOG=warn "$BIN" serve --config sluice.example.toml \
    --listen "127.0.0.1:$port" --data-dir "$WORK/data" &
  pid=$!
  wait_port "$port"
  sleep 0.5
  out=$(MODE=$mode wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s tests/bench/batch10.lua "http://127.0.0.1:$port$path")
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  pid=""
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  refused=$(awk '/^refused-or-failed/ {print $2}' <<<"$out")
  results+=("$mode $(awk -v r="${rps:-0}" 'BEGIN { printf "%.0f", r * 10 }') ${refused:-0}")
  echo "$mode: ${rps:-0} req/s x 10 events; ${refused:-0} requests refused or with failed entries" >&2
}

for _ in $(seq 1 "$ROUNDS"); do
  run cloudevents /buses/default/events
  run aws /
  run rocketmq /putEvents
done

mean() { printf '%s\n' "${results[@]}" | awk -v n="$1" '$1==n {s+=$2; c++} END {printf "%.0f", (c ? s/c : 0)}'; }
bad() { printf '%s\n' "${results[@]}" | awk -v n="$1" '$1==n {s+=$3} END {print s+0}'; }
ce=$(mean cloudevents)
echo
printf '%-28s %12s %8s %10s\n' "10 events per request" "events/s" ratio refused
for mode in cloudevents aws rocketmq; do
  printf '%-28s %12s %8s %10s\n' "$mode" "$(mean $mode)" \
    "$(awk -v a="$(mean $mode)" -v b="$ce" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')" "$(bad $mode)"
done
mkdir -p target/bench
{
  for mode in aws rocketmq; do
    echo "compat.$mode.ratio $(awk -v a="$(mean $mode)" -v b="$ce" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')"
  done
} > target/bench/compat.summary
echo "goal: aws and rocketmq >= 0.90 of the CloudEvents batch, none refused (wrk -t1 -c$CONNECTIONS -d$DURATION, $ROUNDS rounds)"
