#!/usr/bin/env python3
"""Checks the admin API's OpenAPI description and the configuration's JSON Schema.

    check_openapi.py [--spec schemas/openapi.json] [EXCHANGES.json] [--routes]
    check_openapi.py --config-schema [FILE.toml ...]

1. The OpenAPI document is valid OpenAPI 3.1 (openapi-spec-validator).
2. With EXCHANGES.json (recorded requests: a list of
   {"method": "GET", "path": "/api/v1/buses/{bus}", "status": 200,
    "content_type": "application/json", "body": <JSON or null>}, `path` being the route
   template), each (path, method) is documented, its status is documented (or `default`),
   and the body validates against that response's schema for the content type
   (JSON Schema 2020-12, `#/components/...` resolved against the whole document).
3. With --routes, every route of the admin API (gateway/src/admin/**/*.rs but the console)
   and of the drop-in APIs (gateway/src/ingress/compat/**/*.rs) is documented and every
   documented operation is a route. A route that only adds a trailing slash to another
   (`/{namespace}/{broker}/`) is that route's alias and needs no entry of its own.
4. --config-schema: each TOML file (default: the repository's sample configurations)
   validates against schemas/config.schema.json.

Exits 1 listing every mismatch, 0 when all is good; the last line is a summary
("openapi: N passed, M failed").

Requirements: tests/scripts/requirements-openapi.txt (Python 3.11+).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path
from urllib.parse import quote

from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator, validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPEC = ROOT / "schemas" / "openapi.json"
DEFAULT_CONFIG_SCHEMA = ROOT / "schemas" / "config.schema.json"
SPEC_URI = "urn:sluice:openapi"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def pointer(*parts: str) -> str:
    """A URI fragment JSON pointer to `parts` (RFC 6901 escaped, then percent-encoded)."""
    escaped = (p.replace("~", "~0").replace("/", "~1") for p in parts)
    return "#/" + "/".join(quote(p, safe="~") for p in escaped)


def load_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        sys.exit(f"{what} {path}: {e}")


Failures = list[tuple[str, str]]  # (the item checked, what is wrong with it)


def check_spec(spec: dict) -> Failures:
    try:
        validate(spec, cls=OpenAPIV31SpecValidator)
    except Exception as e:  # the validator raises its own error types
        message = getattr(e, "message", None) or str(e).split("\n", 1)[0]
        path = getattr(e, "absolute_path", None)
        at = f" at /{'/'.join(str(p) for p in path)}" if path else ""
        return [("document", f"not valid OpenAPI 3.1{at}: {message}")]
    return []


def resolve(spec: dict, node: dict, where: list[str]) -> tuple[dict, list[str]]:
    """Follows local `$ref`s (response objects, path items); returns the node and its location."""
    seen = 0
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if not ref.startswith("#/") or seen > 16:
            raise ValueError(f"cannot follow $ref {ref!r}")
        where = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
        node = spec
        for part in where:
            node = node[part]
        seen += 1
    return node, where


def media_type(content_type: str | None) -> str | None:
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def find_media(content: dict, mime: str) -> str | None:
    """The content key serving `mime`: exact, then `type/*`, then `*/*`."""
    by_lower = {k.lower(): k for k in content}
    for candidate in (mime, mime.split("/", 1)[0] + "/*", "*/*"):
        if candidate in by_lower:
            return by_lower[candidate]
    return None


def find_response(responses: dict, status: int) -> str | None:
    for key in (str(status), f"{str(status)[0]}XX", f"{str(status)[0]}xx", "default"):
        if key in responses:
            return key
    return None


def check_exchanges(spec: dict, exchanges: list, source: str) -> tuple[int, Failures]:
    registry = Registry().with_resource(
        SPEC_URI, Resource.from_contents(spec, default_specification=DRAFT202012)
    )
    validators: dict[str, Draft202012Validator] = {}
    failures: Failures = []
    paths = spec.get("paths", {})
    for i, ex in enumerate(exchanges):
        if not isinstance(ex, dict):
            failures.append((f"{source}#{i}", f"{source} #{i}: not an object"))
            continue
        method = str(ex.get("method", "")).lower()
        path = ex.get("path")
        status = ex.get("status")
        label = f"{source} #{i} {method.upper()} {path} -> {status}"
        fail = lambda message: failures.append((f"{source}#{i}", f"{label}: {message}"))
        if path not in paths:
            fail("path not documented")
            continue
        item, _ = resolve(spec, paths[path], ["paths", path])
        if method not in item:
            fail(f"method not documented (documented: {', '.join(m.upper() for m in METHODS if m in item)})")
            continue
        if not isinstance(status, int):
            fail("`status` is not an integer")
            continue
        responses = item[method].get("responses", {})
        key = find_response(responses, status)
        if key is None:
            fail(f"status not documented (documented: {', '.join(responses)})")
            continue
        response, where = resolve(spec, responses[key], ["paths", path, method, "responses", key])
        content = response.get("content") or {}
        body = ex.get("body")
        mime = media_type(ex.get("content_type"))
        if not content:
            if body is not None:
                fail("a body was answered, but the response documents none")
            continue
        if mime is None:
            if body is not None:
                fail(f"no content_type recorded for a body (documented: {', '.join(content)})")
            continue
        media_key = find_media(content, mime)
        if media_key is None:
            fail(f"content type {mime} not documented (documented: {', '.join(content)})")
            continue
        if "schema" not in content[media_key] or body is None:
            continue  # no schema, or the body was not recorded (not JSON): nothing to validate
        ref = SPEC_URI + pointer(*where, "content", media_key, "schema")
        validator = validators.get(ref)
        if validator is None:
            validator = Draft202012Validator({"$ref": ref}, registry=registry)
            validators[ref] = validator
        errors = sorted(validator.iter_errors(body), key=lambda e: [str(p) for p in e.absolute_path])
        for error in errors[:5]:
            at = "/" + "/".join(str(p) for p in error.absolute_path)
            fail(f"body at {at}: {error.message}")
        if len(errors) > 5:
            fail(f"... and {len(errors) - 5} more errors in the body")
    return len(exchanges), failures


METHOD_CALL = re.compile(r"(?<![\w:])(get|put|post|delete|patch)\(")
# A method router built by a closure of the same file: `let method = || post(..)...;`
LOCAL_CALL = re.compile(r"^\s*(\w+)\(\)\s*$")


def balanced(text: str, j: int, stop: str = ")") -> int:
    """The index just past the end of the expression starting at `j`: the closing
    bracket that makes the depth negative, or `stop` at depth 0 (bounded by the text)."""
    depth = 0
    while j < len(text):
        c = text[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return j + 1
        elif c == stop and depth == 0:
            return j + 1
        j += 1
    return j


def rust_routes(sources: list[Path]) -> set[tuple[str, str]]:
    """(path, method) of every `.route("...", get(..).put(..))` in the given Rust files; the
    method router may be a call of a closure of the same file (`let method = || post(..);`)."""
    found = set()
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for match in re.finditer(r'\.route\(\s*"([^"]+)"\s*,', text):
            # The method router: up to the call's matching parenthesis.
            router = text[match.end(): balanced(text, match.end()) - 1]
            local = LOCAL_CALL.match(router)
            if local:
                closure = re.search(r"\blet\s+" + re.escape(local.group(1)) + r"\s*=\s*\|[^|]*\|", text)
                if closure:
                    router = text[closure.end(): balanced(text, closure.end(), ";")]
            for method in METHOD_CALL.findall(router):
                found.add((match.group(1), method))
    # `/x/` beside `/x`: the same operation (a trailing slash ignored), documented once.
    return {(p, m) for p, m in found if not (p != "/" and p.endswith("/") and (p[:-1], m) in found)}


def route_sources() -> list[Path]:
    """The admin API's route files (the console's files are not part of the API) and the
    drop-in APIs' (AWS PutEvents, RocketMQ EventBridge, Knative)."""
    src = ROOT / "gateway" / "src"
    admin = (p for p in (src / "admin").rglob("*.rs") if not {"console", "console.rs"} & set(p.relative_to(src).parts))
    return sorted([*admin, *(src / "ingress" / "compat").rglob("*.rs")])


def check_routes(spec: dict) -> tuple[int, Failures]:
    sources = route_sources()
    if not sources:
        return 1, [("routes", "--routes: gateway/src/admin/ and gateway/src/ingress/compat/ hold no route files")]
    missing = [s for s in sources if not s.exists()]
    if missing:
        return 1, [("routes", f"--routes: {m} does not exist") for m in missing]
    routes = rust_routes(sources)
    items = {path: resolve(spec, item, ["paths", path])[0] for path, item in spec.get("paths", {}).items()}
    documented = {(path, method) for path, item in items.items() for method in item if method in METHODS}
    failures: Failures = []
    for p, m in sorted(routes - documented):
        failures.append((f"{m} {p}", f"route {m.upper()} {p} is not documented"))
    for p, m in sorted(documented - routes):
        failures.append((f"{m} {p}", f"documented {m.upper()} {p} is not a route"))
    for p, m in sorted(documented):
        operation = items[p][m]
        if not operation.get("operationId") or not operation.get("summary"):
            failures.append((f"{m} {p}", f"{m.upper()} {p}: needs an operationId and a summary"))
        if p.startswith("/admin/") and not operation.get("deprecated"):
            failures.append((f"{m} {p}", f"{m.upper()} {p}: an /admin alias must be deprecated"))
    return len(routes | documented), failures


def sample_configs() -> list[Path]:
    files = [ROOT / "sluice.example.toml"]
    files += sorted((ROOT / "infra").glob("**/*.toml"))
    files += sorted((ROOT / "tests" / "fixtures").glob("**/*.toml"))
    return [f for f in files if f.is_file()]


def check_configs(schema_path: Path, files: list[Path]) -> tuple[int, Failures]:
    schema = load_json(schema_path, "config schema")
    try:
        Draft202012Validator.check_schema(schema)
    except Exception as e:
        return 1, [("schema", f"{schema_path} is not a valid JSON Schema 2020-12: {e}")]
    validator = Draft202012Validator(schema)
    failures: Failures = []
    for file in files:
        try:
            config = tomllib.loads(file.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            failures.append((str(file), f"{file}: {e}"))
            continue
        for error in sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
            at = ".".join(str(p) for p in error.absolute_path) or "(top level)"
            failures.append((str(file), f"{file}: {at}: {error.message}"))
    return len(files), failures


def report(name: str, checked: int, failures: Failures, what: str) -> int:
    if failures:
        print(f"{len(failures)} mismatch(es):")
        for n, (_, message) in enumerate(failures, 1):
            print(f"  {n}. {message}")
    failed = len({item for item, _ in failures})
    print(f"{name}: checked {what}")
    print(f"{name}: {max(checked - failed, 0)} passed, {failed} failed")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="recorded exchanges (JSON), or TOML files with --config-schema")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="the OpenAPI document")
    parser.add_argument("--routes", action="store_true", help="also compare the document with the axum routes in gateway/src")
    parser.add_argument("--config-schema", action="store_true", help="validate TOML configurations against the configuration schema")
    parser.add_argument("--schema", type=Path, default=DEFAULT_CONFIG_SCHEMA, help="the configuration schema (with --config-schema)")
    args = parser.parse_args()

    if args.config_schema:
        files = args.files or sample_configs()
        checked, failures = check_configs(args.schema, files)
        return report("config-schema", checked, failures, f"{len(files)} file(s) against {args.schema.name}")

    spec = load_json(args.spec, "OpenAPI document")
    failures = check_spec(spec)
    checked, what = 1, [f"{args.spec.name} (OpenAPI 3.1)"]
    if not failures and args.routes:
        n, route_failures = check_routes(spec)
        failures += route_failures
        checked += n
        what.append(f"{n} route(s)")
    if not failures:
        for file in args.files:
            exchanges = load_json(file, "exchanges")
            if not isinstance(exchanges, list):
                failures.append((str(file), f"{file}: expected a JSON list of exchanges"))
                checked += 1
                continue
            n, exchange_failures = check_exchanges(spec, exchanges, file.name)
            failures += exchange_failures
            checked += n
            what.append(f"{n} exchange(s) of {file.name}")
    return report("openapi", checked, failures, ", ".join(what))


if __name__ == "__main__":
    sys.exit(main())
