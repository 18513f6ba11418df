#!/usr/bin/env bash
# Ingest benchmark: wrk (-t1 -c64) posts ~1 KiB events to the bare hyper baseline
# (../shared/bench/baseline, run at the start and at the end) and to sluice (release build),
# each figure a ratio to the baseline's mean in the same run. Configurations, as a user
# writes them (`log = "info"`, no tuning):
#
#   os        one bus (4 shards), no rules, `durability = "os"`
#   fsync     the same with `durability = "fsync"`
#   example   `sluice.example.toml` as `make run` starts it (`fsync`, the sample rule
#             delivering every event to a file while the load runs)
#
# Paths on `os`: a binary-mode event, a structured-mode event, a batch of 10, and a verified
# GitHub webhook (HMAC checked, delivery id deduplicated). For each: req/s, p99, and the CPU
# the gateway spent per accepted event (from /proc ticks over the run) against its budget.
# Then p99 at half the peak rate (os, fsync, example), the observability overhead (OTLP
# export on/off, interleaved; metrics' share of the CPU per request), and, when `perf` can
# profile, a flame graph per path (target/bench/flame-<path>.svg, with inferno) and a table
# of where each µs goes (tests/bench/budget.py).
#
# Writes target/bench/ingest.summary ("key value" lines; tests/bench/summary.py gathers
# them into target/bench/summary.json and compares with the committed previous summary).
#
#   DURATION=10s CONNECTIONS=64 PROFILE=auto|0 tests/bench/ingest.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BASELINE_SRC=${BASELINE_SRC:-$ROOT/../shared/bench/baseline}
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
PROFILE=${PROFILE:-auto}
OUT=$ROOT/target/bench
WORK=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
SUMMARY=$OUT/ingest.summary
: > "$SUMMARY"

# CPU per accepted event each path is held to, in µs (BENCHMARKS.md, "Ingest cost budget").
declare -A BUDGET=([os-binary]=24 [os-structured]=36 [os-batch10]=22 [os-webhook]=40 [fsync-binary]=42 [example-binary]=48)

[ -d "$BASELINE_SRC" ] || { echo "baseline not found at $BASELINE_SRC" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is missing (make bench-ingest installs it)" >&2; exit 1; }

cargo build --release -q -p sluice-gateway -p sluice-tests --bin sluice --bin metrics-cost
cargo build --release -q --manifest-path "$BASELINE_SRC/Cargo.toml" --target-dir "$ROOT/target/bench-baseline"

if [ "$PROFILE" = auto ]; then
  PROFILE=0
  if command -v perf >/dev/null && perf record -q -o "$WORK/probe.data" -- true 2>/dev/null; then PROFILE=1; fi
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 200); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2; return 1
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kib() { awk -v f="$2:" '$1==f {print $2}' "/proc/$1/status"; }
summary() { echo "$1 $2" >> "$SUMMARY"; }

# wrk_run URL SCRIPT [DURATION] → "req/s p99_ms non2xx"
# The share of the machine's CPU time the hypervisor took away (steal) over each load run
# goes to $WORK/steal: on a shared host it can halve a figure, so the report names it.
steal_ticks() { awk '/^cpu / {print $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
wrk_run() {
  local out rps p99 bad s0 s1
  s0=$(steal_ticks)
  out=$(wrk -t1 -c"$CONNECTIONS" -d"${3:-$DURATION}" --latency -s "$2" "$1")
  s1=$(steal_ticks)
  echo "$s0 $s1" | awk '{ printf "%.0f\n", ($4 > $2 ? ($3 - $1) / ($4 - $2) * 100 : 0) }' >> "$WORK/steal"
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us$/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v=v*1000}; print v}' <<<"$out")
  bad=$(awk '/Non-2xx/ {print $5}' <<<"$out")
  refused=$(awk '/^refused-or-failed/ {print $2}' <<<"$out")
  echo "${rps:-0} ${p99:-0} $(( ${bad:-0} + ${refused:-0} ))"
}

# The configurations.
cat > "$WORK/plain.toml" <<'EOF'
listen = "127.0.0.1:8080"
data_dir = "./data"
log = "info"

[[buses]]
name = "default"
shards = 4

[[webhooks]]
name = "github"
bus = "default"
verify = { preset = "github", secret = "bench-secret" }
EOF
body=$(cat tests/bench/event-data.json)
export WEBHOOK_SIGNATURE="sha256=$(printf '%s' "$body" | openssl dgst -sha256 -hmac bench-secret -r | cut -d' ' -f1)"

# start NAME CONFIG DURABILITY [EXTRA_TOML] → sets pid and port
start() {
  local name=$1 config=$2 durability=$3 extra=${4:-}
  port=$(free_port)
  { cat "$config"; printf '\n%s\n' "$extra"; } > "$WORK/$name.toml"
  rm -rf "$WORK/data"
  SLUICE_DURABILITY=$durability "$ROOT/target/release/sluice" serve --config "$WORK/$name.toml" \
    --listen "127.0.0.1:$port" --data-dir "$WORK/data" > "$WORK/$name.log" 2>&1 &
  pid=$!
  wait_port "$port"
  sleep 0.5
}
stop() { kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""; }

rows=()
# measure NAME PATH SCRIPT EVENTS_PER_REQUEST → a row; CPU µs per event into the summary
measure() {
  local name=$1 path=$2 script=$3 per=$4 before after r rps p99 bad us
  before=$(cpu_ticks "$pid")
  r=$(wrk_run "http://127.0.0.1:$port$path" "$script")
  after=$(cpu_ticks "$pid")
  read -r rps p99 bad <<<"$r"
  us=$(awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v r="$rps" -v d="${DURATION%s}" -v n="$per" \
    'BEGIN { printf "%.1f", (r > 0 ? t / hz / (r * n * d) * 1e6 : 0) }')
  rows+=("$name $rps $p99 $bad $us $per")
  summary "ingest.$name.cpu_us_per_event" "$us"
  echo "$name: $rps req/s, p99 $p99 ms, $bad refused; CPU $us us per event; RSS $(( $(rss_kib "$pid" VmHWM) / 1024 )) MiB peak" >&2
}

# profile NAME PATH SCRIPT CPU_US: a short second run under perf, folded into a flame graph
# and the table of where the CPU goes.
profile() {
  [ "$PROFILE" = 1 ] || return 0
  local name=$1 path=$2 script=$3 us=$4
  perf record -q -F 299 --call-graph dwarf,16384 -o "$WORK/perf.data" -p "$pid" -- sleep 4 >/dev/null 2>&1 &
  local perf_pid=$!
  wrk -t1 -c"$CONNECTIONS" -d5s -s "$script" "http://127.0.0.1:$port$path" >/dev/null
  wait "$perf_pid" || true
  perf script --no-inline -i "$WORK/perf.data" 2>/dev/null \
    | python3 tests/bench/budget.py --collapse > "$OUT/flame-$name.folded" || return 0
  if command -v inferno-flamegraph >/dev/null; then
    inferno-flamegraph --title "sluice $name" < "$OUT/flame-$name.folded" > "$OUT/flame-$name.svg" 2>/dev/null || true
  fi
  python3 tests/bench/budget.py --table "$us" < "$OUT/flame-$name.folded" > "$OUT/budget-$name.txt" || true
}

# The baseline, once before and once after: its mean is what every ratio is against.
# baseline → "req/s p99_ms non2xx"
baseline() {
  local port bpid
  port=$(free_port)
  "$ROOT/target/bench-baseline/release/baseline-ingest" "127.0.0.1:$port" >/dev/null 2>&1 &
  bpid=$!
  wait_port "$port"
  wrk_run "http://127.0.0.1:$port/buses/default/events" tests/bench/post.lua
  kill $bpid; wait $bpid 2>/dev/null || true
}
read -r base1 base_p99 _ <<<"$(baseline)"

start os "$WORK/plain.toml" os
measure os-binary /buses/default/events tests/bench/post.lua 1
measure os-structured /buses/default/events tests/bench/structured.lua 1
measure os-batch10 /buses/default/events tests/bench/batch10.lua 10
measure os-webhook /webhooks/github tests/bench/webhook.lua 1
for r in "${rows[@]}"; do
  read -r name _ _ _ us _ <<<"$r"
  case $name in
    os-binary) profile "$name" /buses/default/events tests/bench/post.lua "$us" ;;
    os-structured) profile "$name" /buses/default/events tests/bench/structured.lua "$us" ;;
    os-batch10) profile "$name" /buses/default/events tests/bench/batch10.lua "$us" ;;
    os-webhook) profile "$name" /webhooks/github tests/bench/webhook.lua "$us" ;;
  esac
done
stop

# p99 at half the peak rate: each connection pauses 10 ms after each answer, and there are
# as many connections as make half the peak (half_rate NAME PEAK).
half_rate() {
  local name=$1 peak=$2 conns r rps p99
  conns=$(awk -v p="$peak" 'BEGIN { c = int(p / 2 * 0.0105 + 0.5); printf "%d", (c < 1 ? 1 : c) }')
  r=$(CONNECTIONS=$conns DELAY_MS=10 wrk_run "http://127.0.0.1:$port/buses/default/events" tests/bench/post.lua)
  read -r rps p99 _ <<<"$r"
  summary "ingest.$name.half_rate_p99_ms" "$p99"
  echo "$name at half its peak ($rps req/s offered by $conns connections, 10 ms apart each): p99 $p99 ms" >&2
  half+=("$name $rps $p99")
}
half=()
peak_of() { printf '%s\n' "${rows[@]}" | awk -v n="$1" '$1==n {print $2}'; }
start os "$WORK/plain.toml" os
half_rate os-binary "$(peak_of os-binary)"
stop

start fsync "$WORK/plain.toml" fsync
measure fsync-binary /buses/default/events tests/bench/post.lua 1
half_rate fsync-binary "$(peak_of fsync-binary)"
read -r _ _ _ _ fsync_us _ <<<"$(printf '%s\n' "${rows[@]}" | grep '^fsync-binary ')"
profile fsync-binary /buses/default/events tests/bench/post.lua "$fsync_us"
stop

start example sluice.example.toml fsync
measure example-binary /buses/default/events tests/bench/post.lua 1
half_rate example-binary "$(peak_of example-binary)"
delivered=$(wc -l < "$WORK/data/delivered.jsonl" 2>/dev/null || echo 0)
echo "example-binary: $delivered events delivered by the sample rule during the runs" >&2
stop

# Observability: OTLP export of every trace on and off, interleaved (a second baseline
# process is the collector).
otlp_port=$(free_port)
"$ROOT/target/bench-baseline/release/baseline-ingest" "127.0.0.1:$otlp_port" 2>/dev/null &
otlp_pid=$!
wait_port "$otlp_port"
otlp="[tracing]
otlp_endpoint = \"http://127.0.0.1:$otlp_port\""
obs=()
for variant in plain otlp plain otlp; do
  start "obs-$variant" "$WORK/plain.toml" os "$([ $variant = otlp ] && echo "$otlp")"
  read -r rps _ _ <<<"$(wrk_run "http://127.0.0.1:$port/buses/default/events" tests/bench/post.lua)"
  obs+=("$variant $rps")
  stop
done
kill $otlp_pid; wait $otlp_pid 2>/dev/null || true

read -r base2 _ _ <<<"$(baseline)"
base=$(awk -v a="$base1" -v b="$base2" 'BEGIN { printf "%.0f", (a + b) / 2 }')

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'; }
printf '\n%-16s %10s %9s %8s %8s %12s %8s\n' path "req/s" "p99 ms" refused ratio "CPU us/ev" budget
printf '%-16s %10s %9s %8s %8s %12s %8s\n' baseline "$base" "$base_p99" 0 1.00 "" ""
summary ingest.baseline.rps "$base"
over=0
for r in "${rows[@]}"; do
  read -r name rps p99 bad us per <<<"$r"
  # Batches: the ratio compares events/s with the baseline's requests/s.
  rt=$(ratio "$(awk -v r="$rps" -v n="$per" 'BEGIN { print r * n }')" "$base")
  budget=${BUDGET[$name]:-}
  mark=""
  if [ -n "$budget" ] && awk -v u="$us" -v b="$budget" 'BEGIN { exit !(u > b) }'; then mark=" OVER"; over=$((over + 1)); fi
  printf '%-16s %10s %9s %8s %8s %12s %8s\n' "$name" "$rps" "$p99" "$bad" "$rt" "$us" "${budget}${mark}"
  summary "ingest.$name.ratio" "$rt"
  summary "ingest.$name.p99_ms" "$p99"
done
printf '\n%-16s %10s %9s   (p99 at half the peak rate; goal < 5 ms)\n' path "req/s" "p99 ms"
for h in "${half[@]}"; do printf '%-16s %10s %9s\n' $h; done
os_rps=$(peak_of os-binary)
fsync_rps=$(peak_of fsync-binary)
summary ingest.fsync_over_os "$(ratio "$fsync_rps" "$os_rps")"
echo
echo "fsync / os: $(ratio "$fsync_rps" "$os_rps") (goal >= 0.75)"
mean() { printf '%s\n' "${obs[@]}" | awk -v n="$1" '$1==n {s+=$2; c++} END {printf "%.0f", (c ? s/c : 0)}'; }
awk -v a="$(mean otlp)" -v b="$(mean plain)" 'BEGIN { printf "tracing (OTLP export of every trace): %.0f req/s vs %.0f without: overhead %.1f %% (goal < 5 %%)\n", a, b, (b > 0 ? (1 - a / b) * 100 : 0) }'
metrics_ns=$("$ROOT/target/release/metrics-cost")
os_us=$(printf '%s\n' "${rows[@]}" | awk '$1=="os-binary" {print $5}')
awk -v ns="$metrics_ns" -v us="$os_us" 'BEGIN { printf "metrics: %d ns per event of %.1f us CPU per request: %.2f %% (goal < 5 %%)\n", ns, us, (us > 0 ? ns / (us * 1000) * 100 : 0) }'
webhook_rps=$(peak_of os-webhook)
echo "verified webhooks: $(ratio "$webhook_rps" "$os_rps") of plain binary ingest (goal >= 0.80)"
summary ingest.webhook_over_binary "$(ratio "$webhook_rps" "$os_rps")"
max_steal=$(sort -n "$WORK/steal" | tail -1)
summary ingest.max_steal_pct "${max_steal:-0}"
echo "CPU stolen by the host during the load runs: up to ${max_steal:-0} % of the machine$( [ "${max_steal:-0}" -gt 5 ] && echo ' (over 5 %: the ratios of this run are not comparable; run again on a quiet host)')"
echo "goals: os-binary >= 0.60 of the baseline, fsync-binary >= 0.45, example-binary >= 0.30; p99 at half the peak < 5 ms; CPU per event within its budget ($over over)"
if [ "$PROFILE" = 1 ]; then
  echo
  for f in "$OUT"/budget-*.txt; do echo "== $(basename "$f" .txt)"; cat "$f"; done
  echo "flame graphs: $OUT/flame-*.$(command -v inferno-flamegraph >/dev/null && echo svg || echo 'folded (install inferno for SVGs)')"
fi
