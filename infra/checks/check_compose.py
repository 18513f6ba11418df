"""Checks infra/compose.yaml: the Compose Specification, the services the demo must have,
their health checks and start order, and every Sluice configuration it mounts (with
`sluice check-config`).

    python infra/checks/check_compose.py SLUICE_BINARY [COMPOSE_FILE]

No Docker engine runs here, so this reads the file (PyYAML, merge keys resolved), parses it
with compose-spec (strict: an unknown key or a bad value is an error, as in `docker compose
config`) and checks what `docker compose up` relies on. Exits 1 listing every problem found.
"""

import json
import re
import sys
from pathlib import Path

import compose_spec
import yaml

from sluice_config import INFRA, check_config, image_env

REPLICAS = ["sluice-1", "sluice-2", "sluice-3"]
# The admin token comes from the environment of `compose up`, required, with no default:
# `${SLUICE_ADMIN_TOKEN:?message}` (a default would be a token everyone knows).
REQUIRED_TOKEN = re.compile(r"^\$\{SLUICE_ADMIN_TOKEN:?\?[^}]*\}$")
# Services that run once and exit: a health check means nothing for them.
ONE_SHOT = {"producer"}


def duration_seconds(text):
    """Compose durations (`45s`, `1m30s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def as_env(environment):
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {k: "" if v is None else str(v) for k, v in (environment or {}).items()}


def check(compose_path, binary):
    problems = []
    base = compose_path.parent
    doc = yaml.safe_load(compose_path.read_text())
    try:
        # compose-spec reads no merge keys (<<); PyYAML has resolved them.
        compose_spec.PyCompose.from_json(json.dumps(doc)).validate()
    except ValueError as error:
        problems.append(f"not valid Compose: {error}")
    services = doc.get("services") or {}
    declared_volumes = set((doc.get("volumes") or {}).keys())

    for name in ["redis", "rocketmq-namesrv", "rocketmq-broker", "receiver", *REPLICAS]:
        if name not in services:
            problems.append(f"service {name} is missing")

    for name, svc in services.items():
        image = svc.get("image", "")
        if "build" not in svc:
            if not image or ":" not in image or image.endswith(":latest"):
                problems.append(f"{name}: image {image!r} is not pinned to a version")
        health = svc.get("healthcheck")
        if name not in ONE_SHOT:
            if not health or health.get("disable") or not health.get("test"):
                problems.append(f"{name}: no health check")
            elif health["test"][0] not in ("CMD", "CMD-SHELL"):
                problems.append(f"{name}: health check test must start with CMD or CMD-SHELL")
        depends = svc.get("depends_on") or {}
        if isinstance(depends, list):
            problems.append(f"{name}: depends_on is a list; use conditions (service_healthy)")
            depends = {}
        for dep, how in depends.items():
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep}")
                continue
            condition = (how or {}).get("condition")
            if condition != "service_healthy":
                problems.append(f"{name}: depends on {dep} without condition: service_healthy")
            elif not services[dep].get("healthcheck"):
                problems.append(f"{name}: waits for {dep} to be healthy, which has no health check")
        for volume in svc.get("volumes") or []:
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source")
            if source.startswith((".", "/")):
                if not (base / source).exists():
                    problems.append(f"{name}: mounts {source}, which does not exist")
                # The demo's scripts run as mounted: they must at least compile.
                for script in sorted((base / source).rglob("*.py")) if (base / source).is_dir() else []:
                    try:
                        compile(script.read_text(), str(script), "exec")
                    except SyntaxError as error:
                        problems.append(f"{name}: {script.name}:{error.lineno}: does not compile: {error.msg}")
            elif source not in declared_volumes:
                problems.append(f"{name}: named volume {source} is not declared")

    redis = services.get("redis") or {}
    command = redis.get("command") or []
    command = command if isinstance(command, list) else command.split()
    if "--appendonly" not in command or command[command.index("--appendonly") + 1] != "yes":
        problems.append("redis: not started with --appendonly yes (a 202 must survive Redis)")

    for name, program in [("rocketmq-namesrv", "mqnamesrv"), ("rocketmq-broker", "mqbroker")]:
        svc = services.get(name) or {}
        if not str(svc.get("image", "")).startswith("apache/rocketmq:"):
            problems.append(f"{name}: not the official apache/rocketmq image")
        if program not in (svc.get("command") or []):
            problems.append(f"{name}: does not run {program}")
    broker = services.get("rocketmq-broker") or {}
    if "rocketmq-namesrv:9876" not in (broker.get("command") or []):
        problems.append("rocketmq-broker: does not register with rocketmq-namesrv:9876 (-n)")

    image_vars = image_env()
    worker_ids, host_ports = set(), set()
    for name in REPLICAS:
        svc = services.get(name)
        if not svc:
            continue
        build = svc.get("build") or {}
        dockerfile = (base / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()
        if dockerfile != (INFRA / "Dockerfile").resolve():
            problems.append(f"{name}: not built from infra/Dockerfile (got {dockerfile})")
        env = {**image_vars, **as_env(svc.get("environment"))}
        if env.get("SLUICE_MODE") != "distributed":
            problems.append(f"{name}: SLUICE_MODE is not distributed")
        worker = env.get("SLUICE_WORKER_ID")
        if not worker or worker in worker_ids:
            problems.append(f"{name}: SLUICE_WORKER_ID missing or shared with another replica")
        worker_ids.add(worker)
        for port in svc.get("ports") or []:
            host = str(port).rsplit(":", 1)[0]
            if host in host_ports:
                problems.append(f"{name}: host port {host} used twice")
            host_ports.add(host)
            if not host.startswith("127.0.0.1:"):
                problems.append(f"{name}: port {port} is published on every interface (publish the demo on 127.0.0.1)")
        token = str(as_env(svc.get("environment")).get("SLUICE_ADMIN_TOKEN", ""))
        if not REQUIRED_TOKEN.match(token):
            problems.append(
                f"{name}: SLUICE_ADMIN_TOKEN is {token!r}: it must come from the environment with no default (${{SLUICE_ADMIN_TOKEN:?...}})"
            )
        test = " ".join((svc.get("healthcheck") or {}).get("test") or [])
        listen_port = env.get("SLUICE_LISTEN", "").rsplit(":", 1)[-1]
        if not re.search(rf"127\.0\.0\.1:{listen_port}/(readyz|healthz)\b", test):
            problems.append(f"{name}: health check does not probe /readyz or /healthz on port {listen_port}")
        if duration_seconds(svc.get("stop_grace_period", "10s")) < 35:
            problems.append(f"{name}: stop_grace_period under 35 s: SIGTERM drains requests for up to 30 s")
        config_target = env.get("SLUICE_CONFIG")
        mounted = None
        for volume in svc.get("volumes") or []:
            parts = volume.split(":")
            if len(parts) >= 2 and parts[1] == config_target:
                mounted = base / parts[0]
        if mounted is None:
            problems.append(f"{name}: nothing is mounted at SLUICE_CONFIG ({config_target})")
            continue
        if re.search(r"^\s*allow_local_without_token\s*=\s*true", mounted.read_text(), re.MULTILINE):
            problems.append(f"{name}: {mounted.name} sets admin.allow_local_without_token (the demo must require a token)")
        checked_env = {k: v for k, v in env.items() if k.startswith("SLUICE_")}
        # A stand-in for the token `compose up` requires from its environment.
        checked_env["SLUICE_ADMIN_TOKEN"] = "check-config"
        ok, output = check_config(binary, mounted, checked_env)
        if not ok:
            problems.append(f"{name}: sluice check-config {mounted} failed: {output}")
    return problems


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = Path(sys.argv[1])
    compose_path = Path(sys.argv[2]) if len(sys.argv) > 2 else INFRA / "compose.yaml"
    problems = check(compose_path, binary)
    for problem in problems:
        print(f"compose: {problem}")
    if problems:
        sys.exit(1)
    print(f"compose: {compose_path.name} ok ({len(yaml.safe_load(compose_path.read_text())['services'])} services)")


if __name__ == "__main__":
    main()
