// The builder's model: a channel as a graph, and its conversion to and from a rule.
//
//   sources (what stores events on the bus: its ingress, webhook sources, RocketMQ sources)
//     → filter (pattern, CESQL, or every event) → transform steps → targets
//
// Every source of the bus feeds the filter: a rule takes every event of its bus, whichever
// source stored it. From the filter on, the graph is a tree: every node but the sources
// and the filter has at most one input, so the transform chain of a target is the steps on
// the path from the filter to it. Loading a rule shares the common first steps of its targets' chains; saving gives
// each target the chain of its path. Pure data: no DOM here.
//
// A function step is `{"wasm": "name"}` in a rule (no `form`): the graph holds it as
// `{form: "WASM", wasm: "name"}` like the other steps, and converts it back on the way
// out (`stepFromApi`, `stepToApi`).

export const STEP_FORMS = [
  "ORIGINAL",
  "CONSTANT",
  "JSONPATH",
  "TEMPLATE",
  "SET_ATTRIBUTES",
  "REMOVE_ATTRIBUTES",
  "RENAME_ATTRIBUTES",
  "MAP_DATA",
  "WASM",
];

/** The console's name of a step form where it is not the form itself. */
export const STEP_TITLES = {
  WASM: "Function (WASM)",
};

export function stepTitle(form) {
  return STEP_TITLES[form] || form;
}

export const TARGET_TYPES = ["log", "file", "http", "rocketmq", "redis-stream", "bus", "function"];

/** Steps that render a body: they must come last unless they carry `"into": "data"`. */
export const BODY_FORMS = new Set(["CONSTANT", "JSONPATH", "TEMPLATE"]);

/** Targets without a retry policy or dead-letter destination (they do not fail). */
export const LOCAL_TARGETS = new Set(["log", "file"]);

export const NAME_PATTERN = /^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$/;

export const STEP_INFO = {
  ORIGINAL: "The event unchanged",
  CONSTANT: "A fixed body",
  JSONPATH: "The body is what a JSONPath selects",
  TEMPLATE: "A body from a template with ${variables}",
  SET_ATTRIBUTES: "Set attributes (constants or JSONPaths)",
  REMOVE_ATTRIBUTES: "Remove attributes",
  RENAME_ATTRIBUTES: "Rename attributes",
  MAP_DATA: "Build new data from fields",
  WASM: "Runs a WebAssembly function of the catalog: maps, drops or fans out each event",
};

export const TARGET_INFO = {
  log: "JSON lines on standard output",
  file: "JSON lines in a file",
  http: "POST to an HTTP endpoint",
  rocketmq: "A message on a RocketMQ topic",
  "redis-stream": "XADD to a Redis stream",
  bus: "Onto another bus",
  function: "POST to a function; its reply onto a bus",
};

/** A new step of a form, with empty settings to fill in. */
export function newStep(form) {
  switch (form) {
    case "CONSTANT":
      return { form, value: {} };
    case "JSONPATH":
      return { form, value: "$.data" };
    case "TEMPLATE":
      return { form, value: { id: "$.id" }, template: '{"id": ${id}}' };
    case "SET_ATTRIBUTES":
    case "RENAME_ATTRIBUTES":
      return { form, attributes: {} };
    case "REMOVE_ATTRIBUTES":
      return { form, attributes: [] };
    case "MAP_DATA":
      return { form, fields: {} };
    case "WASM":
      return { form, wasm: "" };
    default:
      return { form: "ORIGINAL" };
  }
}

/** A new target of a type, with what it needs pre-filled where there is a sensible default. */
export function newTarget(type, name) {
  switch (type) {
    case "file":
      return { type, name, path: `{data_dir}/${name}.jsonl` };
    case "http":
      return { type, name, url: "" };
    case "rocketmq":
      return { type, name, name_server: "127.0.0.1:9876", topic: "" };
    case "redis-stream":
      return { type, name, stream: "" };
    case "bus":
      return { type, name, bus: "" };
    case "function":
      return { type, name, url: "", reply_bus: "" };
    default:
      return { type: "log", name };
  }
}

/** A step as a rule holds it, as the graph holds it: `{"wasm": "f"}` → `{form: "WASM", wasm: "f"}`. */
export function stepFromApi(step) {
  if (step && typeof step === "object" && !Array.isArray(step) && step.form === undefined && step.wasm !== undefined) {
    return { form: "WASM", ...clone(step) };
  }
  return clone(step);
}

/** A step of the graph as a rule holds it: a function step is exactly `{"wasm": "f"}`. */
export function stepToApi(data) {
  if (data?.form === "WASM") return { wasm: data.wasm ?? "" };
  return clone(data);
}

export function clone(value) {
  return value === undefined ? undefined : JSON.parse(JSON.stringify(value));
}

/** JSON text with object keys sorted: equal for equal values. */
export function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (value && typeof value === "object") {
    return `{${Object.keys(value)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`)
      .join(",")}}`;
  }
  return JSON.stringify(value);
}

/** A transform as the API holds it (absent, a step, or a list) as a list of steps. */
export function stepsOf(transform) {
  if (transform === undefined || transform === null) return [];
  return Array.isArray(transform) ? transform : [transform];
}

/** Reads `a.b.c` of an object. */
export function getPath(object, path) {
  return path.split(".").reduce((value, key) => (value === undefined || value === null ? undefined : value[key]), object);
}

/** Sets `a.b.c` of an object; `undefined` deletes it, and parents left empty with it. */
export function setPath(object, path, value) {
  const keys = path.split(".");
  const parents = [object];
  let at = object;
  for (const key of keys.slice(0, -1)) {
    if (at[key] === undefined || at[key] === null || typeof at[key] !== "object") {
      if (value === undefined) return;
      at[key] = {};
    }
    at = at[key];
    parents.push(at);
  }
  const last = keys[keys.length - 1];
  if (value === undefined) delete at[last];
  else at[last] = value;
  if (value === undefined) {
    for (let i = keys.length - 1; i > 0; i -= 1) {
      if (Object.keys(parents[i]).length === 0) delete parents[i - 1][keys[i - 1]];
      else break;
    }
  }
}

export class Graph {
  constructor() {
    /** id → {id, kind: source|filter|step|target, data, x, y} */
    this.nodes = new Map();
    /** [{from, to}]; every node has at most one input. */
    this.edges = [];
    this.nextId = 1;
  }

  /**
   * The graph of a rule of `bus` (a new rule: `rule` null). `sources`: what else feeds the
   * bus besides its ingress, as source node data (`{type: "webhook", name, preset, path}`,
   * or a RocketMQ source resource `{type: "rocketmq", name, topic, ...}`).
   */
  static fromRule(bus, rule, sources = []) {
    const graph = new Graph();
    const source = graph.add("source", { type: "ingress", bus });
    const mode = rule?.filter !== undefined ? "filter" : rule?.pattern !== undefined && Object.keys(rule.pattern).length ? "pattern" : "all";
    const filter = graph.add("filter", {
      mode,
      pattern: mode === "pattern" ? JSON.stringify(rule.pattern, null, 2) : '{\n  "type": ["com.example.order.created"]\n}',
      filter: mode === "filter" ? rule.filter : "type LIKE 'com.example.%'",
    });
    graph.connect(source.id, filter.id);
    for (const data of sources) graph.connect(graph.add("source", { ...clone(data), bus }).id, filter.id);
    for (const target of rule?.targets || []) {
      let at = filter;
      for (const step of stepsOf(target.transform).map(stepFromApi)) {
        const key = canonical(step);
        const same = graph.childrenOf(at.id).find((n) => n.kind === "step" && canonical(n.data) === key);
        if (same) at = same;
        else {
          const node = graph.add("step", step);
          graph.connect(at.id, node.id);
          at = node;
        }
      }
      const data = clone(target);
      delete data.transform;
      const node = graph.add("target", data);
      graph.connect(at.id, node.id);
    }
    graph.layout();
    return graph;
  }

  /** The bus's ingress (the first source). */
  get source() {
    return [...this.nodes.values()].find((n) => n.kind === "source");
  }

  /** Every source feeding the bus: its ingress first. */
  sources() {
    return [...this.nodes.values()].filter((n) => n.kind === "source");
  }

  get filter() {
    return [...this.nodes.values()].find((n) => n.kind === "filter");
  }

  add(kind, data, x = 0, y = 0) {
    const node = { id: `n${this.nextId++}`, kind, data, x, y };
    this.nodes.set(node.id, node);
    return node;
  }

  get(id) {
    return this.nodes.get(id);
  }

  /** Target nodes, in the order the rule lists them. */
  targets() {
    return [...this.nodes.values()].filter((n) => n.kind === "target");
  }

  steps() {
    return [...this.nodes.values()].filter((n) => n.kind === "step");
  }

  parentOf(id) {
    const edge = this.edges.find((e) => e.to === id);
    return edge ? this.nodes.get(edge.from) : null;
  }

  childrenOf(id) {
    return this.edges.filter((e) => e.from === id).map((e) => this.nodes.get(e.to));
  }

  static hasOutput(node) {
    return node.kind === "filter" || node.kind === "step";
  }

  static hasInput(node) {
    return node.kind === "step" || node.kind === "target";
  }

  /** Whether `from`'s output may feed `to`; `reason` says why not. */
  canConnect(fromId, toId) {
    const from = this.nodes.get(fromId);
    const to = this.nodes.get(toId);
    if (!from || !to) return { ok: false, reason: "no such node" };
    if (!Graph.hasOutput(from)) return { ok: false, reason: `${label(from)} has no output` };
    if (!Graph.hasInput(to)) return { ok: false, reason: `${label(to)} has no input` };
    if (fromId === toId) return { ok: false, reason: "a node cannot feed itself" };
    for (let at = from; at; at = this.parentOf(at.id)) {
      if (at.id === toId) return { ok: false, reason: `${label(to)} comes before ${label(from)}: that would be a loop` };
    }
    if (this.parentOf(toId)?.id === fromId) return { ok: false, reason: "they are connected already" };
    return { ok: true };
  }

  /**
   * Connects `from` → `to`, replacing `to`'s input. Throws if not allowed. A source is
   * added to the filter's inputs (every source of the bus feeds it).
   */
  connect(fromId, toId) {
    const from = this.nodes.get(fromId);
    const to = this.nodes.get(toId);
    if (from?.kind === "source") {
      if (!this.edges.some((e) => e.from === fromId && e.to === toId)) this.edges.push({ from: fromId, to: toId });
      return to;
    }
    const check = this.canConnect(fromId, toId);
    if (!check.ok) throw new Error(check.reason);
    this.edges = this.edges.filter((e) => e.to !== toId);
    this.edges.push({ from: fromId, to: toId });
    return to;
  }

  disconnect(toId) {
    this.edges = this.edges.filter((e) => e.to !== toId);
  }

  /** Removes a step or target. A step's outputs go to its input, so the chain stays whole. */
  remove(id) {
    const node = this.nodes.get(id);
    if (!node || node.kind === "source" || node.kind === "filter") return;
    const parent = this.parentOf(id);
    const children = this.childrenOf(id);
    this.edges = this.edges.filter((e) => e.from !== id && e.to !== id);
    if (parent) for (const child of children) this.edges.push({ from: parent.id, to: child.id });
    this.nodes.delete(id);
  }

  /** The steps from the filter to `id` (excluded), or null if `id` is not reached from it. */
  pathTo(id) {
    const steps = [];
    let at = this.parentOf(id);
    while (at && at.kind === "step") {
      steps.unshift(at);
      at = this.parentOf(at.id);
    }
    return at && at.kind === "filter" ? steps : null;
  }

  /** Whether a step leads to at least one target. */
  leadsToTarget(id) {
    return this.childrenOf(id).some((n) => n.kind === "target" || this.leadsToTarget(n.id));
  }

  /**
   * The rule this graph stands for: `{rule, targetIds, problems}`. `targetIds[i]` is the node
   * of `rule.targets[i]`; `problems` ([{node, field, message}], `node` null for the rule)
   * are what must be fixed before it can be saved. `invalid` maps a node id to its settings
   * that do not parse (kept by the inspector).
   */
  toRule(invalid = new Map()) {
    const rule = {};
    const problems = [];
    const filter = this.filter;
    const f = filter.data;
    if (f.mode === "pattern") {
      try {
        const pattern = JSON.parse(f.pattern || "{}");
        if (!pattern || typeof pattern !== "object" || Array.isArray(pattern)) throw new Error("a pattern is a JSON object");
        rule.pattern = pattern;
      } catch (e) {
        problems.push({ node: filter.id, field: "pattern", message: `The pattern is not valid JSON: ${e.message}` });
      }
    } else if (f.mode === "filter") {
      if (!f.filter || !f.filter.trim()) problems.push({ node: filter.id, field: "filter", message: "Write a CESQL expression, or choose every event." });
      rule.filter = f.filter || "";
    }
    rule.targets = [];
    const targetIds = [];
    const names = new Set();
    for (const node of this.targets()) {
      const target = clone(node.data);
      if (LOCAL_TARGETS.has(target.type)) {
        delete target.retry;
        delete target.dead_letter;
      }
      const path = this.pathTo(node.id);
      if (!path) {
        problems.push({ node: node.id, field: null, message: "Not connected: connect it to the filter or to a step." });
      } else if (path.length) {
        target.transform = path.map((s) => stepToApi(s.data));
      }
      if (!target.name || !NAME_PATTERN.test(target.name)) {
        problems.push({ node: node.id, field: "name", message: "A target needs a name: letters, digits, '-', '_', '.' (not first)." });
      } else if (names.has(target.name)) {
        problems.push({ node: node.id, field: "name", message: `Two targets are named "${target.name}".` });
      }
      names.add(target.name);
      rule.targets.push(target);
      targetIds.push(node.id);
    }
    for (const step of this.steps()) {
      if (!this.pathTo(step.id)) problems.push({ node: step.id, field: null, message: "Not connected: connect its input to the filter or to a step." });
      else if (!this.leadsToTarget(step.id)) problems.push({ node: step.id, field: null, message: "Leads to no target: connect its output to a target." });
      else if (BODY_FORMS.has(step.data.form) && step.data.into !== "data" && this.childrenOf(step.id).some((n) => n.kind === "step")) {
        problems.push({ node: step.id, field: "into", message: `${step.data.form} renders the body, so it must be the last step: tick "Make it the new data, and go on", or put the steps after it before it.` });
      }
    }
    for (const [id, fields] of invalid) {
      if (!this.nodes.has(id)) continue;
      for (const [field, message] of Object.entries(fields)) problems.push({ node: id, field, message });
    }
    if (!rule.targets.length) problems.push({ node: null, field: null, message: "Add a target: drag one from the palette, or use its Add button." });
    return { rule, targetIds, problems };
  }

  /**
   * Where a refusal points, in this graph: `pointer` is inside the rule (`/targets/0/retry`,
   * `/pattern/type/0`, `/filter`), `targetIds` the draft's target order. Returns
   * `{node, field}` (`node` null: the rule as a whole; `field` a dotted key of the node's
   * settings, or null).
   */
  locate(pointer, detail, targetIds) {
    if (!pointer) return { node: null, field: null };
    const parts = pointer
      .split("/")
      .slice(1)
      .map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"));
    const [head, ...rest] = parts;
    if (head === "name") return { node: null, field: "name" };
    if (head === "bus") return { node: this.source.id, field: null };
    if (head === "pattern" || head === "filter") return { node: this.filter.id, field: head };
    if (head === "targets") {
      const index = Number(rest[0]);
      const id = targetIds[index];
      if (rest.length === 0 || id === undefined) return { node: null, field: null };
      if (rest[1] === "transform") {
        let step = rest[2] !== undefined ? Number(rest[2]) : Number((String(detail).match(/\bstep (\d+)/) || [])[1]);
        const path = this.pathTo(id) || [];
        if (Number.isInteger(step) && path[step]) {
          return { node: path[step].id, field: rest.slice(3).join(".") || null };
        }
        return { node: id, field: null };
      }
      return { node: id, field: rest.slice(1).join(".") || null };
    }
    return { node: null, field: null };
  }

  /**
   * Places the nodes in columns by depth, each subtree in its own band of rows; the sources
   * in the first column, around the filter.
   */
  layout() {
    const COLUMN = 240;
    const ROW = 104;
    const MARGIN = 24;
    const depth = new Map();
    const rows = new Map();
    let nextRow = 0;
    const place = (node, d) => {
      depth.set(node.id, d);
      const children = this.childrenOf(node.id);
      if (!children.length) {
        rows.set(node.id, nextRow);
        nextRow += 1;
        return;
      }
      for (const child of children) place(child, d + 1);
      const childRows = children.map((c) => rows.get(c.id));
      rows.set(node.id, (Math.min(...childRows) + Math.max(...childRows)) / 2);
    };
    place(this.filter, 1);
    // Nodes not reached from the filter (being wired): below the rest.
    for (const node of this.nodes.values()) {
      if (node.kind !== "source" && !depth.has(node.id) && !this.parentOf(node.id)) place(node, node.kind === "target" ? 3 : 2);
    }
    const sources = this.sources();
    const first = rows.get(this.filter.id) - (sources.length - 1) / 2;
    sources.forEach((node, i) => {
      depth.set(node.id, 0);
      rows.set(node.id, first + i);
    });
    // Sources above the filter's band push everything down.
    const top = Math.min(0, ...rows.values());
    for (const [id, row] of rows) rows.set(id, row - top);
    const maxStep = Math.max(1, ...[...this.nodes.values()].filter((n) => n.kind !== "target").map((n) => depth.get(n.id) ?? 1));
    for (const node of this.nodes.values()) {
      const column = node.kind === "target" ? Math.max(maxStep + 1, depth.get(node.id) ?? 2) : depth.get(node.id) ?? 2;
      node.x = MARGIN + column * COLUMN;
      node.y = MARGIN + (rows.get(node.id) ?? 0) * ROW;
    }
  }
}

/** How a node is called in messages. */
export function label(node) {
  if (!node) return "";
  switch (node.kind) {
    case "source":
      return node.data.type === "webhook" ? `webhook source ${node.data.name}` : node.data.type === "rocketmq" ? `RocketMQ source ${node.data.name}` : `bus ${node.data.bus}`;
    case "filter":
      return "the filter";
    case "step":
      return node.data.form === "WASM" ? `function step ${node.data.wasm || "(no function)"}` : `step ${node.data.form}`;
    default:
      return `target ${node.data.name || node.data.type}`;
  }
}
