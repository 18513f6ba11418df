// The settings of each step form and target type, as the inspector shows them. A field's
// `key` is its dotted path in the step or target (`retry.max_attempts`), the same path a
// refusal's JSON pointer names, so an error lands on its field.
//
// kinds: text, secret, number, integer, duration, bool, select, json (any JSON value),
// object (a JSON object), lines (a list of strings, one per line), text-or-json, bus
// (a bus of the catalog), function (a WebAssembly function of the catalog).
// `requiredMessage` replaces "<label> is required." for a required field left empty.

import { duration } from "./format.js";

const DURATION = "e.g. 250ms, 30s, 5m, 1h";

export const STEP_FIELDS = {
  ORIGINAL: [],
  CONSTANT: [
    { key: "value", label: "Body", kind: "text-or-json", hint: "JSON, or text (sent as text/plain)." },
    { key: "into", label: "Make it the new data, and go on", kind: "into" },
  ],
  JSONPATH: [
    { key: "value", label: "JSONPath", kind: "text", required: true, placeholder: "$.data.order", hint: "The selected value becomes the body: $.data.x, $.type, $.myextension." },
    { key: "into", label: "Make it the new data, and go on", kind: "into" },
  ],
  TEMPLATE: [
    { key: "value", label: "Variables", kind: "object", hint: 'Name → JSONPath, e.g. {"id": "$.data.id"}.' },
    { key: "template", label: "Template", kind: "textarea", required: true, hint: "${name} inserts a variable. Starting with { or [ makes a JSON template." },
    { key: "into", label: "Make it the new data, and go on", kind: "into" },
  ],
  SET_ATTRIBUTES: [
    {
      key: "attributes",
      label: "Attributes",
      kind: "object",
      hint: 'Name → value: a constant, or a JSONPath ("$.data.id"); {"value": "$..."} for a constant starting with $.',
    },
  ],
  REMOVE_ATTRIBUTES: [{ key: "attributes", label: "Attributes to remove", kind: "lines", hint: "One name per line (not id, source, type or specversion)." }],
  RENAME_ATTRIBUTES: [{ key: "attributes", label: "Renames", kind: "object", hint: 'Old name → new name, e.g. {"region": "zone"}.' }],
  MAP_DATA: [
    { key: "fields", label: "Fields", kind: "object", hint: 'Target path → JSONPath or {"value": constant}, e.g. {"order.id": "$.data.orderId"}.' },
    { key: "keep", label: "Keep the existing data (fields go on top)", kind: "bool" },
    { key: "remove", label: "Paths to remove from the kept data", kind: "lines", hint: "One dotted path per line." },
  ],
  WASM: [
    {
      key: "wasm",
      label: "Function",
      kind: "function",
      required: true,
      requiredMessage: "Choose the function this step calls.",
      hint: "It gets each event and returns the events to pass on: none drops it, several fan it out (the steps after it run on each). An error dead-letters the event.",
    },
  ],
};

export const RETRY_FIELDS = [
  { key: "retry.max_attempts", label: "Max attempts", kind: "integer", placeholder: "185", hint: "The first attempt included." },
  { key: "retry.max_event_age", label: "Max event age", kind: "duration", placeholder: "24h", hint: "Counted from the event's acceptance." },
  { key: "retry.initial_backoff", label: "Initial backoff", kind: "duration", placeholder: "from [delivery]", hint: DURATION },
  { key: "retry.max_backoff", label: "Max backoff", kind: "duration", placeholder: "from [delivery]", hint: DURATION },
];

export const TARGET_FIELDS = {
  log: [],
  file: [{ key: "path", label: "Path", kind: "text", required: true, hint: "{data_dir} is the data directory." }],
  http: [
    { key: "url", label: "URL", kind: "text", required: true, placeholder: "scheme://host:port/path", hint: "http or https; redirects are not followed." },
    { key: "mode", label: "Mode", kind: "select", options: [["", "binary (default)"], ["binary", "binary: ce- headers"], ["structured", "structured: the event as JSON"], ["raw", "raw: the data only"]] },
    { key: "headers", label: "Headers", kind: "object", hint: 'e.g. {"x-team": "orders"}' },
    { key: "timeout", label: "Timeout", kind: "duration", placeholder: "10s", hint: DURATION },
    { key: "connect_timeout", label: "Connect timeout", kind: "duration", hint: DURATION },
    { key: "auth.type", label: "Authentication", kind: "select", resets: "auth", options: [["", "none"], ["bearer", "Bearer token"], ["basic", "Basic"], ["api-key", "API key header"]] },
    { key: "auth.token", label: "Token", kind: "secret", when: (d) => d.auth?.type === "bearer", hint: "or env:VAR" },
    { key: "auth.username", label: "User name", kind: "text", when: (d) => d.auth?.type === "basic" },
    { key: "auth.password", label: "Password", kind: "secret", when: (d) => d.auth?.type === "basic", hint: "or env:VAR" },
    { key: "auth.header", label: "Header", kind: "text", when: (d) => d.auth?.type === "api-key", placeholder: "x-api-key" },
    { key: "auth.key", label: "Key", kind: "secret", when: (d) => d.auth?.type === "api-key", hint: "or env:VAR" },
    { key: "signing_secret", label: "Signing secret", kind: "secret", hint: "Standard Webhooks: whsec_... or env:VAR" },
    { key: "rate_limit", label: "Rate limit (events/s)", kind: "number" },
    { key: "max_in_flight", label: "Max in flight", kind: "integer", placeholder: "16" },
    { key: "concurrent", label: "Send a batch's events concurrently", kind: "bool" },
    { key: "circuit_breaker.failures", label: "Circuit breaker: failures in a row", kind: "integer", placeholder: "5" },
    { key: "circuit_breaker.open_for", label: "Circuit breaker: open for", kind: "duration", hint: DURATION },
    { key: "ca_file", label: "CA file", kind: "text", hint: "PEM roots to trust besides the platform's." },
    { key: "http2_prior_knowledge", label: "HTTP/2 without TLS (h2c)", kind: "bool" },
  ],
  rocketmq: [
    { key: "name_server", label: "Name server", kind: "text", required: true, placeholder: "host:9876", hint: "host:port, ';'-separated." },
    { key: "topic", label: "Topic", kind: "text", required: true },
    { key: "tag_attribute", label: "Tag attribute", kind: "text", hint: "The attribute whose value is the tag." },
    { key: "tag", label: "Tag", kind: "text", hint: "A fixed tag, without tag attribute." },
    { key: "keys_attribute", label: "Keys attribute", kind: "text", placeholder: "id" },
    { key: "partition_key_attribute", label: "Partition key attribute", kind: "text", placeholder: "partitionkey" },
    { key: "producer_group", label: "Producer group", kind: "text" },
    { key: "max_batch", label: "Max batch", kind: "integer", placeholder: "100" },
    { key: "max_batch_bytes", label: "Max batch bytes", kind: "integer", placeholder: "1048576" },
    { key: "max_in_flight", label: "Max in flight", kind: "integer", placeholder: "8" },
    { key: "send_timeout", label: "Send timeout", kind: "duration", hint: DURATION },
  ],
  "redis-stream": [
    { key: "url", label: "Redis URL", kind: "text", placeholder: "redis://127.0.0.1:6379", hint: "or env:VAR" },
    { key: "stream", label: "Stream", kind: "text", required: true },
    { key: "maxlen", label: "Max length", kind: "integer", placeholder: "100000" },
  ],
  bus: [{ key: "bus", label: "Bus", kind: "bus", required: true }],
  function: [
    { key: "url", label: "URL", kind: "text", required: true, placeholder: "scheme://host:port/path" },
    { key: "reply_bus", label: "Reply bus", kind: "bus", required: true, hint: "Where a CloudEvent in the answer goes." },
    { key: "max_hops", label: "Max hops", kind: "integer", placeholder: "8", hint: "Functions an event may pass through, to stop loops." },
    { key: "timeout", label: "Timeout", kind: "duration", placeholder: "30s", hint: DURATION },
  ],
};

/** Text of a field's value for its control. */
export function displayValue(spec, value) {
  if (value === undefined || value === null) return "";
  switch (spec.kind) {
    case "object":
    case "json":
      return JSON.stringify(value, null, 2);
    case "text-or-json":
      return typeof value === "string" ? value : JSON.stringify(value, null, 2);
    case "lines":
      return Array.isArray(value) ? value.join("\n") : String(value);
    case "duration":
      return duration(value);
    default:
      return String(value);
  }
}

/**
 * A field's value from its control's text: `undefined` for empty (the key is removed).
 * Throws an Error whose message says what is wrong.
 */
export function parseValue(spec, text) {
  const trimmed = text.trim();
  if (!trimmed) return undefined;
  switch (spec.kind) {
    case "integer": {
      if (!/^-?\d+$/.test(trimmed)) throw new Error("A whole number.");
      return Number(trimmed);
    }
    case "number": {
      const n = Number(trimmed);
      if (!Number.isFinite(n)) throw new Error("A number.");
      return n;
    }
    case "duration":
      if (!/^\s*(\d+(\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$/.test(trimmed)) throw new Error(`Not a duration (${DURATION}).`);
      return trimmed;
    case "object": {
      let value;
      try {
        value = JSON.parse(trimmed);
      } catch (e) {
        throw new Error(`Not valid JSON: ${e.message}`);
      }
      if (!value || typeof value !== "object" || Array.isArray(value)) throw new Error("A JSON object: {\"name\": value}.");
      return value;
    }
    case "json":
      try {
        return JSON.parse(trimmed);
      } catch (e) {
        throw new Error(`Not valid JSON: ${e.message}`);
      }
    case "text-or-json":
      try {
        return JSON.parse(trimmed);
      } catch {
        return text;
      }
    case "lines":
      return trimmed
        .split("\n")
        .map((l) => l.trim())
        .filter(Boolean);
    default:
      return text;
  }
}
