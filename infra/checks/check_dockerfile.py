"""Checks infra/Dockerfile for what hadolint does not know we need, and the configuration
it bakes in with `sluice check-config` in the image's environment.

    python infra/checks/check_dockerfile.py SLUICE_BINARY [DOCKERFILE]

Exits 1 listing every problem found.
"""

import re
import sys
import tomllib
from pathlib import Path

from sluice_config import INFRA, check_config, image_env


def instructions(text):
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [l for l in text.splitlines() if not l.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = line.strip().split(None, 1)
        if words:
            out.append((words[0].upper(), words[1] if len(words) > 1 else ""))
    return out


def check(dockerfile, binary):
    problems = []
    steps = instructions(dockerfile.read_text())
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    if len(stages) < 2:
        problems.append("not a multi-stage build")
    final = steps[stages[-1]:] if stages else steps
    ops = {}
    for op, args in final:
        ops.setdefault(op, []).append(args)
    builds = [args for op, args in steps if op == "RUN" and "cargo build" in args]
    if not any(re.search(r"cargo build --release --locked -p sluice-gateway\b", b) for b in builds):
        problems.append("no `cargo build --release --locked -p sluice-gateway`")
    # The toolchain and the version label follow the workspace.
    workspace = tomllib.loads((INFRA.parent / "Cargo.toml").read_text())["workspace"]["package"]
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    pinned = tuple(int(n) for n in args.get("RUST_VERSION", "0").split("."))
    needed = tuple(int(n) for n in workspace["rust-version"].split("."))
    if pinned < needed[: len(pinned)]:
        problems.append(f"RUST_VERSION {args.get('RUST_VERSION')} is older than the workspace's rust-version {workspace['rust-version']}")
    if args.get("VERSION") != workspace["version"]:
        problems.append(f"ARG VERSION {args.get('VERSION')} is not the workspace version {workspace['version']}")
    user = (ops.get("USER") or [""])[-1].split(":")[0]
    if user in ("", "0", "root"):
        problems.append("the image runs as root (no USER, or USER root)")
    health = " ".join(ops.get("HEALTHCHECK") or [])
    if "/healthz" not in health:
        problems.append("no HEALTHCHECK on /healthz")
    if "SIGTERM" not in " ".join(ops.get("STOPSIGNAL") or []):
        problems.append("STOPSIGNAL is not SIGTERM (Sluice drains and hands over on SIGTERM)")
    env = image_env(dockerfile)
    port = env.get("SLUICE_LISTEN", "").rsplit(":", 1)[-1]
    if not env.get("SLUICE_LISTEN", "").startswith("0.0.0.0:"):
        problems.append("SLUICE_LISTEN is not 0.0.0.0:PORT: the default loopback is unreachable from outside")
    if port not in " ".join(ops.get("EXPOSE") or []).split():
        problems.append(f"the listen port {port} is not EXPOSEd")
    if port and f"127.0.0.1:{port}/" not in health:
        problems.append(f"the HEALTHCHECK does not probe the listen port {port}")
    labels = " ".join(ops.get("LABEL") or [])
    for label in ("org.opencontainers.image.title", "org.opencontainers.image.source", "org.opencontainers.image.licenses"):
        if label not in labels:
            problems.append(f"no {label} label")
    # The configuration baked in: the COPY to SLUICE_CONFIG, checked in the image's environment.
    config = env.get("SLUICE_CONFIG")
    sources = [args.split()[-2] for op, args in final if op == "COPY" and args.split()[-1] == config]
    if not sources:
        problems.append(f"nothing is copied to SLUICE_CONFIG ({config})")
    for source in sources:
        path = INFRA.parent / source  # the build context is the repository root
        if not path.exists():
            problems.append(f"{source} (copied to {config}) does not exist")
            continue
        ok, output = check_config(binary, path, {k: v for k, v in env.items() if k.startswith("SLUICE_")})
        if not ok:
            problems.append(f"sluice check-config {source} in the image's environment failed: {output}")
    return problems


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    dockerfile = Path(sys.argv[2]) if len(sys.argv) > 2 else INFRA / "Dockerfile"
    problems = check(dockerfile, Path(sys.argv[1]))
    for problem in problems:
        print(f"dockerfile: {problem}")
    if problems:
        sys.exit(1)
    print(f"dockerfile: {dockerfile.name} ok (multi-stage, non-root, HEALTHCHECK, baked configuration valid)")


if __name__ == "__main__":
    main()
