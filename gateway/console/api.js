// The admin API client: every request of the console goes through `request`, which adds
// the operator's token, reads problem+json answers into an ApiError, and tells the
// application when credentials are needed (401, 403).

const TOKEN_KEY = "sluice.adminToken";

/** `/api/v1/` next to the console (`/console/` → `/api/v1/`), so a path prefix works. */
const BASE = new URL("../api/v1/", document.baseURI);

/** An answer that is not 2xx: `status`, and the problem's `detail`, `pointer`, `field`. */
export class ApiError extends Error {
  constructor(status, problem, fallback) {
    const detail = problem?.detail || problem?.title || fallback || `HTTP ${status}`;
    super(detail);
    this.name = "ApiError";
    this.status = status;
    this.problem = problem || {};
  }

  get detail() {
    return this.message;
  }

  /** The field at fault (a JSON pointer) of a refused resource, if the answer names one. */
  get pointer() {
    return typeof this.problem.pointer === "string" ? this.problem.pointer : null;
  }

  /** Credentials would help: not a refusal of where the request came from (host, origin). */
  get isAuth() {
    const where = ["host", "origin", "sec-fetch-site", "content-type"].includes(this.problem.field);
    return this.status === 401 || (this.status === 403 && !where);
  }
}

// ---------------------------------------------------------------------------------------
// Credentials

export function token() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

export function setToken(value) {
  try {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // Storage may be off (private mode): the token then lives as long as the page.
  }
  memoryToken = value || "";
}

let memoryToken = "";
const authListeners = new Set();

/** `listener(error)` is called whenever the API answers 401 or 403. */
export function onAuthNeeded(listener) {
  authListeners.add(listener);
  return () => authListeners.delete(listener);
}

// ---------------------------------------------------------------------------------------
// Requests

/**
 * Sends a request to `/api/v1/{path}`. `body` is sent as JSON; `headers` are added.
 * Resolves to `{status, data, etag, headers}`; rejects with an ApiError for any answer
 * that is not 2xx, or a network failure (status 0).
 */
export async function request(method, path, { body, headers = {}, signal } = {}) {
  const init = {
    method,
    headers: { Accept: "application/json, application/problem+json", ...headers },
    signal,
    cache: "no-store",
    credentials: "same-origin",
  };
  const bearer = token() || memoryToken;
  if (bearer) init.headers.Authorization = `Bearer ${bearer}`;
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(new URL(path.replace(/^\//, ""), BASE), init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, null, `The gateway does not answer (${err.message}). Is it running?`);
  }
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }
  if (!response.ok) {
    const problem = data && typeof data === "object" ? data : null;
    const error = new ApiError(response.status, problem, typeof data === "string" ? data.slice(0, 300) : response.statusText);
    if (error.isAuth) for (const listener of authListeners) listener(error);
    throw error;
  }
  const etag = response.headers.get("ETag");
  return { status: response.status, data, etag: etag ? etag.replace(/^W\//, "").replace(/"/g, "") : null, headers: response.headers };
}

export async function get(path, options) {
  return (await request("GET", path, options)).data;
}

export async function post(path, body, options = {}) {
  return (await request("POST", path, { ...options, body })).data;
}

/** A path segment, escaped. */
export function seg(name) {
  return encodeURIComponent(name);
}

// ---------------------------------------------------------------------------------------
// The endpoints the console uses

export const catalog = () => get("catalog");
export const connectors = () => get("connectors");
export const cluster = () => get("cluster");

/** The catalog's webhook sources and this replica's own (from its configuration file). */
export const webhooks = () => get("webhooks");

/** The source connectors of the catalog (RocketMQ). */
export const sources = () => get("sources");

/** The WebAssembly functions of the catalog, with whether this replica has loaded each. */
export const functions = () => get("functions");

export const getSource = (name) => request("GET", `sources/${seg(name)}`);

/** Replaces a source (`If-Match: version`), or creates it (`version` null: `If-None-Match: *`). */
export const putSource = (name, body, version) =>
  request("PUT", `sources/${seg(name)}`, {
    body,
    headers: version === null || version === undefined ? { "If-None-Match": "*" } : { "If-Match": `"${version}"` },
  });

export const getRule = (bus, rule) => request("GET", `buses/${seg(bus)}/rules/${seg(rule)}`);

/** Creates (`version` null: `If-None-Match: *`) or replaces (`If-Match: version`) a rule. */
export const putRule = (bus, rule, body, version) =>
  request("PUT", `buses/${seg(bus)}/rules/${seg(rule)}`, {
    body,
    headers: version === null || version === undefined ? { "If-None-Match": "*" } : { "If-Match": `"${version}"` },
  });

export const deleteRule = (bus, rule, version) =>
  request("DELETE", `buses/${seg(bus)}/rules/${seg(rule)}`, { headers: version === undefined ? {} : { "If-Match": `"${version}"` } });

export const putBus = (bus, body, version) =>
  request("PUT", `buses/${seg(bus)}`, {
    body,
    headers: version === null || version === undefined ? { "If-None-Match": "*" } : { "If-Match": `"${version}"` },
  });

export const deleteBus = (bus, version) =>
  request("DELETE", `buses/${seg(bus)}`, { headers: version === undefined ? {} : { "If-Match": `"${version}"` } });

/** Checks a catalog change without writing it. */
export const dryRun = (body, signal) => post("catalog/apply?dry_run=true", body, { signal });

export const testRule = (body, signal) => post("rules/test", body, { signal });

export const recentEvents = (bus, limit = 20) => get(`buses/${seg(bus)}/events?limit=${limit}`);

export const redeliver = (bus, rule, body) => post(`buses/${seg(bus)}/rules/${seg(rule)}/redeliver`, body);

export const replays = (bus) => get(`buses/${seg(bus)}/replays`);
export const startReplay = (bus, body) => post(`buses/${seg(bus)}/replays`, body);
export const cancelReplay = (bus, id) => request("DELETE", `buses/${seg(bus)}/replays/${seg(id)}`);

/**
 * Pause, resume or restart a connector (`bus/rule/target` or `source/NAME`) or one of its
 * tasks (`task`: the shard or index).
 */
export function connectorAction(connectorId, action, task) {
  const parts = connectorId.split("/");
  let path;
  if (parts[0] === "source" && parts.length === 2) {
    path = `sources/${seg(parts[1])}`;
  } else if (parts.length === 3) {
    path = `connectors/${parts.map(seg).join("/")}`;
  } else {
    throw new Error(`not a connector: ${connectorId}`);
  }
  if (task !== undefined && task !== null) path += `/tasks/${seg(task)}`;
  return post(`${path}/${action}`);
}

/** A resource as a request body: without its `version`. */
export function withoutVersion(resource) {
  const { version: _version, ...rest } = resource || {};
  return rest;
}
