#!/usr/bin/env python3
"""Where the gateway's CPU per event goes, from a perf profile.

  perf script --no-inline | budget.py --collapse > path.folded   (folded stacks, for inferno)
  budget.py --table CPU_US < path.folded                          (µs per event by stage)

Each sample is charged to the deepest stage of the request path its stack passes through
(a malloc inside the CloudEvent parser counts as parsing, a syscall inside the log append
as the append), so the stages add up to the whole. CPU_US is the CPU per event measured
over the run (ingest.sh): each stage's share of the samples times that.
"""

import re
import sys

# (stage, substrings of a frame's symbol), the deeper of two matching frames wins.
STAGES = [
    ("HTTP: hyper, sockets", ["hyper::", "hyper_util::", "tokio::net::", "tcp_", "sock_", "__x64_sys_sendto", "__x64_sys_recvfrom", "__x64_sys_write", "__x64_sys_read", "epoll"]),
    ("tokio scheduling", ["tokio::runtime::"]),
    ("routing and middleware", ["axum::", "tower::", "app::router", "matchit::"]),
    ("handler: headers, id, response", ["ingress::events::", "ingress::accept::read_body", "http_body_util::"]),
    ("keys and rate limits", ["ingress::auth::", "ingress::ratelimit::", "IngressState::admit"]),
    ("webhook verification", ["ingress::webhooks::", "hmac::", "sha2::"]),
    ("parse and check the event", ["event::http::", "event::stored::", "cloudevents::", "ingress::accept::entry", "store::append::prepare"]),
    ("JSON Schema", ["ingress::schema::", "jsonschema::"]),
    ("dedup", ["store::dedup::", "embedded::dedup::", "accept::store_unique"]),
    ("answer body", ["ingress::events::respond", "events::accepted_body"]),
    ("log append", ["store::embedded::log::", "store::append::append", "EmbeddedLog", "store::embedded::segment::"]),
    ("fsync", ["sync_data", "fdatasync", "__x64_sys_fdatasync", "Syncer", "log::Flusher", "sync_file_range", "log::write_back"]),
    ("metrics", ["sluice::metrics::", "prometheus_client::"]),
    ("logs and spans", ["tracing_subscriber::", "tracing_core::", "tracing::span", "otlp::"]),
    ("delivery (rules, targets)", ["sluice::runtime::", "sluice::targets::", "sluice_functions::"]),
]
ALLOC = ["mi_", "_mi_", "mimalloc", "__rust_alloc", "__rust_dealloc", "__rdl_", "malloc", "free"]


def collapse(lines):
    stacks = {}
    comm, frames = None, []

    def flush():
        if comm is not None and frames:
            key = ";".join([comm] + frames[::-1])
            stacks[key] = stacks.get(key, 0) + 1

    for line in lines:
        if not line.strip():
            flush()
            comm, frames = None, []
        elif not line[0].isspace():
            flush()
            comm, frames = line.split()[0], []
        else:
            parts = line.strip().split(" ", 1)
            sym = parts[1] if len(parts) > 1 else parts[0]
            sym = re.sub(r"\+0x[0-9a-f]+", "", sym)
            sym = re.sub(r" \([^)]*\)$", "", sym).strip() or "[unknown]"
            frames.append(sym.replace(";", ":"))
    flush()
    for key, count in stacks.items():
        print(f"{key} {count}")


def stage_of(frames):
    found = "other"
    for frame in frames:
        for stage, needles in STAGES:
            if any(n in frame for n in needles):
                found = stage
    return found


def table(cpu_us):
    totals, alloc, samples = {}, 0, 0
    for line in sys.stdin:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        samples += n
        stage = stage_of(frames)
        totals[stage] = totals.get(stage, 0) + n
        if any(frames[-1].startswith(a) or a in frames[-1] for a in ALLOC):
            alloc += n
    if samples == 0:
        print("no samples")
        return
    print(f"{'stage':<34} {'share':>7} {'us/event':>9}")
    for stage, n in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{stage:<34} {n / samples * 100:6.1f}% {n / samples * cpu_us:9.2f}")
    print(f"{'(of which allocator, all stages)':<34} {alloc / samples * 100:6.1f}% {alloc / samples * cpu_us:9.2f}")
    print(f"{samples} samples, {cpu_us} us CPU per event over the run")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--collapse":
        collapse(sys.stdin)
    elif len(sys.argv) >= 3 and sys.argv[1] == "--table":
        table(float(sys.argv[2]))
    else:
        sys.exit(__doc__)
