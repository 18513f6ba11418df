"""Checks the Kubernetes manifests under infra/k8s.

    python infra/checks/check_k8s.py SLUICE_BINARY KUBECTL OUT_DIR

1. Builds every overlay with kustomize (`kubectl kustomize`, kustomize built in) and writes
   the output to OUT_DIR/<overlay>.yaml (checkov reads it from there).
2. Validates every object, from the source files and from each build, against the schemas
   in strict mode (an unknown field is an error, as `kubectl apply --validate=strict`):
   Kubernetes objects with kubernetes-validate's bundled OpenAPI schemas, for the oldest
   and the newest Kubernetes the manifests support; KEDA's ScaledObject and the Prometheus
   Operator's ServiceMonitor with JSON Schemas made from the cloudcoil models of their CRDs.
3. Checks what the schemas cannot: probes on /healthz and /readyz, a preStop and a grace
   period that covers Sluice's drain, resources, the security context, selectors that
   match, autoscalers that point at the workload, the admin API (a required token Secret,
   a port of its own on no Service, admitted by the NetworkPolicy only from selected
   peers), and the rendered configuration itself with `sluice check-config`, in the
   container's environment.

Exits 1 listing every problem found.
"""

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

from sluice_config import INFRA, check_config, image_env

K8S = INFRA / "k8s"
OVERLAYS = ["standalone", "distributed", "distributed-keda"]
# The preStop sleep action needs 1.30; 1.37 is the newest schema kubernetes-validate has.
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
CRD_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
}
# What SIGTERM takes at most: requests in flight get 30 s (gateway/src/server.rs DRAIN);
# stopping tasks, committing and releasing leases takes a few seconds more.
DRAIN_SECONDS = 30
STOP_SECONDS = 5
# The Secret holding SLUICE_ADMIN_TOKEN, which the operator creates (never in the build).
ADMIN_SECRET = "sluice-admin"


def strict(schema):
    """Every object schema that lists its properties refuses others (kubectl's strict mode)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


CRD_VALIDATORS = {
    key: jsonschema.Draft202012Validator(strict(model.model_json_schema(by_alias=True)))
    for key, model in CRD_MODELS.items()
}


def where(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name')}"


def validate_schema(doc, origin):
    """Schema problems of one object (strict)."""
    problems = []
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_VALIDATORS:
        for error in CRD_VALIDATORS[key].iter_errors(doc):
            path = ".".join(str(p) for p in error.absolute_path) or "(root)"
            problems.append(f"{origin}: {where(doc)}: {path}: {error.message[:300]}")
        return problems
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{origin}: {where(doc)}: no schema for {key} in Kubernetes {version}")
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path) or "(root)"
            problems.append(f"{origin}: {where(doc)}: Kubernetes {version}: {path}: {error.message[:300]}")
    return problems


def source_objects():
    """Every Kubernetes object in the source files (kustomization files are kustomize's)."""
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") in ("Kustomization", "Component"):
                continue
            yield path.relative_to(INFRA.parent), doc


def build(kubectl, overlay):
    done = subprocess.run(
        [str(kubectl), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return None, done.stderr.strip()
    return done.stdout, None


def probe_path(probe):
    return ((probe or {}).get("httpGet") or {}).get("path")


def check_workload(overlay, docs, binary):
    """The properties of the rendered workload that make it a correct Sluice deployment."""
    problems = []
    say = lambda text: problems.append(f"overlay {overlay}: {text}")  # noqa: E731
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    expected = "StatefulSet" if overlay == "standalone" else "Deployment"
    workloads = by_kind.get(expected, [])
    if len(workloads) != 1 or any(k in by_kind for k in {"StatefulSet", "Deployment"} - {expected}):
        say(f"expected exactly one {expected} and no other workload")
        return problems
    workload = workloads[0]
    spec = workload["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"].get("labels") or {}
    containers = {c["name"]: c for c in pod["containers"]}
    sluice = containers.get("sluice")
    if sluice is None:
        say("no container named sluice")
        return problems

    image = sluice.get("image", "")
    if "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
        say(f"image {image!r} is not pinned to a version or digest")
    if probe_path(sluice.get("livenessProbe")) != "/healthz":
        say("liveness probe is not GET /healthz")
    if probe_path(sluice.get("readinessProbe")) != "/readyz":
        say("readiness probe is not GET /readyz")
    if probe_path(sluice.get("startupProbe")) not in ("/healthz", "/readyz"):
        say("no startup probe (recovery or waiting for Redis would trip liveness)")
    pre_stop = (sluice.get("lifecycle") or {}).get("preStop") or {}
    pause = (pre_stop.get("sleep") or {}).get("seconds")
    if not pause:
        say("no preStop sleep: the listener closes on SIGTERM before endpoints are updated")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace < (pause or 0) + DRAIN_SECONDS + STOP_SECONDS:
        say(f"terminationGracePeriodSeconds {grace} < preStop {pause} + drain {DRAIN_SECONDS} + stop {STOP_SECONDS}")
    resources = sluice.get("resources") or {}
    for kind in ("requests", "limits"):
        for what in ("cpu", "memory"):
            if what not in (resources.get(kind) or {}):
                say(f"no {what} {kind}")
    pod_security = pod.get("securityContext") or {}
    security = sluice.get("securityContext") or {}
    if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
        say("not runAsNonRoot")
    if not security.get("readOnlyRootFilesystem"):
        say("root filesystem is writable")
    if security.get("allowPrivilegeEscalation") is not False:
        say("allowPrivilegeEscalation is not false")
    if "ALL" not in ((security.get("capabilities") or {}).get("drop") or []):
        say("capabilities are not all dropped")
    if pod.get("automountServiceAccountToken") is not False:
        say("the service account token is mounted")

    # Selectors that select the pods.
    selector = spec["selector"].get("matchLabels") or {}
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        say(f"{expected} selector {selector} does not match its pod labels {labels}")
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for doc in by_kind.get(kind, []):
            sel = doc["spec"].get("selector") if kind == "Service" else (
                doc["spec"].get("selector") or doc["spec"].get("podSelector") or {}
            ).get("matchLabels")
            if not sel or any(labels.get(k) != v for k, v in sel.items()):
                say(f"{where(doc)} selector {sel} does not select the pods")
    ports = {p.get("name") for p in sluice.get("ports") or []}
    for doc in by_kind.get("Service", []):
        for port in doc["spec"]["ports"]:
            if port.get("targetPort") not in ports and port.get("targetPort") not in {
                p.get("containerPort") for p in sluice.get("ports") or []
            }:
                say(f"{where(doc)} targets port {port.get('targetPort')}, which the container lacks")
    for doc in by_kind.get("ServiceMonitor", []):
        service_ports = {p.get("name") for s in by_kind.get("Service", []) for p in s["spec"]["ports"]}
        for endpoint in doc["spec"]["endpoints"]:
            if endpoint.get("port") not in service_ports:
                say(f"{where(doc)} scrapes port {endpoint.get('port')}, which no Service has")
            if endpoint.get("path") != "/metrics":
                say(f"{where(doc)} does not scrape /metrics")

    # Mounts: the configuration, and a writable data directory.
    env = {**image_env(), **resolve_env(sluice, workload, by_kind, problems, overlay)}
    mounts = {m["mountPath"]: m for m in sluice.get("volumeMounts") or []}
    data_dir = env.get("SLUICE_DATA_DIR")
    if data_dir not in mounts or mounts[data_dir].get("readOnly"):
        say(f"the data directory {data_dir} is not a writable volume (the root filesystem is read-only)")
    config_path = Path(env.get("SLUICE_CONFIG", ""))
    config_mount = mounts.get(str(config_path.parent))
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    config_map_name = None
    if config_mount and "configMap" in volumes.get(config_mount["name"], {}):
        config_map_name = volumes[config_mount["name"]]["configMap"]["name"]
    config_maps = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    if config_map_name not in config_maps:
        say(f"SLUICE_CONFIG {config_path} is not mounted from a ConfigMap of this build")
    else:
        text = (config_maps[config_map_name].get("data") or {}).get(config_path.name)
        if text is None:
            say(f"ConfigMap {config_map_name} has no key {config_path.name}")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                file = Path(tmp) / config_path.name
                file.write_text(text)
                ok, output = check_config(binary, file, {k: v for k, v in env.items() if k.startswith("SLUICE_")})
            if not ok:
                say(f"sluice check-config of ConfigMap {config_map_name} failed: {output}")

    problems += check_admin(overlay, sluice, by_kind, env, config_maps.get(config_map_name))

    # Mode-specific shape.
    if overlay == "standalone":
        if spec.get("replicas") != 1:
            say("standalone must run exactly one replica")
        claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates") or []}
        if data_dir not in mounts or mounts[data_dir]["name"] not in claims:
            say("the data directory is not on a volumeClaimTemplate")
        if env.get("SLUICE_MODE") != "standalone":
            say("SLUICE_MODE is not standalone")
        for kind in ("HorizontalPodAutoscaler", "ScaledObject"):
            if kind in by_kind:
                say(f"standalone cannot scale out, yet has a {kind}")
    else:
        if env.get("SLUICE_MODE") != "distributed" or not env.get("SLUICE_REDIS_URL"):
            say("not distributed with a SLUICE_REDIS_URL")
        scalers = by_kind.get("HorizontalPodAutoscaler", []) + by_kind.get("ScaledObject", [])
        if len(scalers) != 1:
            say(f"expected one autoscaler (HPA or KEDA ScaledObject), found {len(scalers)}")
        for doc in scalers:
            target = doc["spec"]["scaleTargetRef"]
            if target.get("name") != workload["metadata"]["name"] or target.get("kind", "Deployment") != "Deployment":
                say(f"{where(doc)} does not scale Deployment/{workload['metadata']['name']}")
        if overlay == "distributed-keda":
            triggers = {t["type"]: t for t in by_kind["ScaledObject"][0]["spec"]["triggers"]} if "ScaledObject" in by_kind else {}
            query = (triggers.get("prometheus") or {}).get("metadata", {}).get("query", "")
            if "sluice_subscription_lag_events" not in query:
                say("the ScaledObject does not scale on sluice_subscription_lag_events")
            # KEDA's admission webhook (2.17 and later): a fallback needs a trigger other
            # than cpu or memory whose metric type is AverageValue.
            scaled = by_kind["ScaledObject"][0]["spec"] if "ScaledObject" in by_kind else {}
            if scaled.get("fallback") and not any(
                t["type"] not in ("cpu", "memory") and t.get("metricType", "AverageValue") == "AverageValue"
                for t in scaled.get("triggers", [])
            ):
                say("the ScaledObject's fallback needs a trigger (not cpu or memory) of metricType AverageValue")
        if spec.get("strategy", {}).get("rollingUpdate", {}).get("maxUnavailable") not in (0, "0", "0%"):
            say("a rollout may take a replica away before its successor is ready (maxUnavailable)")
    return problems


def check_admin(overlay, container, by_kind, env, config_map):
    """The admin API requires a token and listens on a port of its own that only operator
    pods may reach: the token's Secret is not optional, no configuration opts out of the
    token, the admin port is on no Service, and the NetworkPolicy admits it only `from`
    selected peers."""
    problems = []
    say = lambda text: problems.append(f"overlay {overlay}: {text}")  # noqa: E731
    token = next((v for v in container.get("env") or [] if v["name"] == "SLUICE_ADMIN_TOKEN"), None)
    ref = ((token or {}).get("valueFrom") or {}).get("secretKeyRef")
    if not ref:
        say("SLUICE_ADMIN_TOKEN does not come from a Secret (the admin API must require a token)")
    elif ref.get("optional", False) is not False:
        say(f"SLUICE_ADMIN_TOKEN's Secret {ref.get('name')} is optional: without it the admin API would run without a token")
    for text in ((config_map or {}).get("data") or {}).values():
        if any(line.split("#", 1)[0].replace(" ", "") == "allow_local_without_token=true" for line in text.splitlines()):
            say("the configuration sets admin.allow_local_without_token")
    listen = env.get("SLUICE_ADMIN_LISTEN", "")
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    admin_port = listen.rsplit(":", 1)[-1]
    if not listen or "admin" not in ports or str(ports["admin"]) != admin_port:
        say(f"the admin API is not on its own container port named admin (SLUICE_ADMIN_LISTEN={listen!r}, ports {ports})")
        return problems
    if ports["admin"] == ports.get("http"):
        say("the admin port is the HTTP port")
    for doc in by_kind.get("Service", []):
        for port in doc["spec"]["ports"]:
            if port.get("targetPort") in ("admin", ports["admin"]):
                say(f"{where(doc)} exposes the admin port")
    policies = by_kind.get("NetworkPolicy", [])
    if not policies:
        say("no NetworkPolicy restricts the admin port")
    for doc in policies:
        for rule in doc["spec"].get("ingress") or []:
            rule_ports = {p.get("port") for p in rule.get("ports") or []}
            reaches_admin = not rule_ports or rule_ports & {"admin", ports["admin"]}
            if reaches_admin and not rule.get("from"):
                say(f"{where(doc)} admits the admin port from anywhere")
    return problems


def resolve_env(container, workload, by_kind, problems, overlay):
    """The container's variables as the pod sees them (Secrets and ConfigMaps of this build,
    the pod name for fieldRef metadata.name)."""
    env = {}
    secrets = {d["metadata"]["name"]: d for d in by_kind.get("Secret", [])}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var.get("valueFrom") or {}
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = secrets.get(ref["name"])
            if secret is None and ref["name"] == ADMIN_SECRET:
                # The operator creates it (the admin token); required, checked below.
                env[var["name"]] = "operator-secret"
                continue
            if secret is None or ref["key"] not in (secret.get("data") or {}):
                problems.append(f"overlay {overlay}: {var['name']} refers to Secret {ref['name']} key {ref['key']}, not in this build")
                continue
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        elif "fieldRef" in source and source["fieldRef"]["fieldPath"] == "metadata.name":
            env[var["name"]] = f"{workload['metadata']['name']}-0"
        else:
            problems.append(f"overlay {overlay}: {var['name']}: a source this check does not resolve")
    return env


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    binary, kubectl, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    problems, counted = [], 0
    for origin, doc in source_objects():
        problems += validate_schema(doc, origin)
        counted += 1
    for overlay in OVERLAYS:
        text, error = build(kubectl, overlay)
        if text is None:
            problems.append(f"overlay {overlay}: kustomize build failed: {error}")
            continue
        (out / f"{overlay}.yaml").write_text(text)
        docs = [d for d in yaml.safe_load_all(text) if d]
        for doc in docs:
            problems += validate_schema(doc, f"kustomize build overlays/{overlay}")
        counted += len(docs)
        problems += check_workload(overlay, docs, binary)
    for problem in problems:
        print(f"k8s: {problem}")
    if problems:
        sys.exit(1)
    print(
        f"k8s: {counted} objects valid (Kubernetes {' and '.join(KUBERNETES_VERSIONS)}, strict;"
        f" KEDA and Prometheus Operator CRDs), overlays {', '.join(OVERLAYS)} built and checked"
    )


if __name__ == "__main__":
    main()
