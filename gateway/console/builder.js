// The builder: a rule drawn as a channel (sources → filter → transform steps → targets) on
// a canvas, edited node by node in a side form, checked as you type by a dry-run apply,
// saved with If-Match, and tried out on a sample event (POST /api/v1/rules/test).
//
// The sources are everything that stores events on the bus: its ingress, the webhook
// sources of this replica (read-only) and the RocketMQ sources of the catalog (edited in
// their own form, saved apart from the rule with PUT /api/v1/sources/{name}).
//
// Everything the mouse does has a keyboard way: each palette item has an Add button (the
// node goes after the selected one), nodes are buttons (arrow keys move them, Delete
// removes them), and the side form has "Input from" and "Connect output to" choices.
//
// A function step (`{"wasm": "name"}` in the rule) is a step of form "WASM" here, with a
// `wasm` setting chosen among the catalog's functions (GET /api/v1/functions).

import * as api from "./api.js";
import { announce, append, button, clip, confirmDialog, field, h, keyed, notice, replace, select, setFieldError, setText, svg, uid } from "./dom.js";
import { badge, brief, bytes, count, duration, json, time } from "./format.js";
import { RETRY_FIELDS, STEP_FIELDS, TARGET_FIELDS, displayValue, parseValue } from "./fields.js";
import { BODY_FORMS, Graph, LOCAL_TARGETS, NAME_PATTERN, STEP_FORMS, STEP_INFO, TARGET_INFO, TARGET_TYPES, canonical, clone, getPath, label, newStep, newTarget, setPath, stepTitle, stepToApi } from "./graph.js";

const DRAG_TYPE = "application/x-sluice-node";
const VALIDATE_DELAY = 400;
const COLUMN = 240;
const ROW = 104;

/** The settings of a RocketMQ source its form edits (the name and the bus are fixed). */
const ROCKETMQ_SOURCE_FIELDS = [
  { key: "name_server", label: "Name server", required: true, placeholder: "host:9876", hint: "host:port, or several separated by ;" },
  { key: "topic", label: "Topic", required: true, hint: "The topic consumed into the bus." },
  { key: "consumer_group", label: "Consumer group", placeholder: "sluice-source-{name}", hint: "Empty: sluice-source-{name}." },
  { key: "tasks", label: "Tasks", integer: true, placeholder: "1", hint: "The topic's queues are spread over this many tasks (1 to 1024)." },
  { key: "wrap_type", label: "Type of wrapped messages", placeholder: "org.apache.rocketmq.message", hint: "The CloudEvent type of a message that is not a CloudEvent." },
  { key: "wrap_source", label: "Source of wrapped messages", placeholder: "rocketmq://{topic}", hint: "Empty: rocketmq://{topic}." },
];

const SAMPLE_EVENT = {
  specversion: "1.0",
  id: "sample-1",
  source: "/console",
  type: "com.example.order.created",
  subject: "order/1",
  datacontenttype: "application/json",
  data: { orderId: "A-1", total: 42, customer: { name: "Ada", tier: "gold" } },
};

/** Shows the builder for `bus`/`rule` (`rule` empty: a new rule; `bus` empty: a picker). */
export async function renderBuilder(root, { bus, rule }, app) {
  if (!bus) return renderPicker(root, app);
  replace(root, h("div", { class: "view-loading" }, notice("loading", "Loading the channel…")));
  let catalog;
  let connectors = [];
  let webhooks = [];
  let sources = null;
  let loaded = null;
  // null: the list cannot be had (the function step then takes a typed name).
  let functions = null;
  let functionsError = null;
  try {
    // The webhook sources, the source list and the functions are extras: the builder works without them.
    [catalog, connectors, webhooks, sources] = await Promise.all([
      api.catalog(),
      api.connectors().then((c) => c.items, () => []),
      api.webhooks().then((w) => w?.items || [], () => []),
      api.sources().then((s) => s?.items || null, () => null),
      api.functions().then(
        (f) => (functions = Array.isArray(f?.items) ? f.items : []),
        (err) => (functionsError = err.detail),
      ),
    ]);
    if (rule) loaded = (await api.getRule(bus, rule)).data;
  } catch (err) {
    if (err.isAuth) return null;
    replace(root, notice("error", rule ? `Rule ${rule} of bus ${bus} cannot be loaded` : `Bus ${bus} cannot be loaded`, err.detail, h("a", { href: "#/channels", class: "button", text: "Back to channels" })));
    return null;
  }
  const busResource = catalog.buses.find((b) => b.name === bus);
  if (!busResource) {
    replace(root, notice("error", `There is no bus ${bus}`, "It may have been deleted.", h("a", { href: "#/channels", class: "button", text: "Back to channels" })));
    return null;
  }
  const feeders = [
    ...webhooks.filter((w) => w?.bus === bus).map((w) => ({ type: "webhook", name: w.name, preset: w.preset || w.verify?.preset, path: w.path || `/webhooks/${w.name}`, origin: w.origin, unavailable: w.unavailable })),
    ...(sources || catalog.sources || []).filter((s) => s?.bus === bus),
  ];
  const builder = new Builder(root, app, { bus, busResource, catalog, connectors, rule: loaded, feeders, functions, functionsError });
  builder.render();
  return builder;
}

class Builder {
  constructor(root, app, { bus, busResource, catalog, connectors, rule, feeders = [], functions = null, functionsError = null }) {
    this.root = root;
    this.app = app;
    this.bus = bus;
    this.busResource = busResource;
    this.catalog = catalog;
    /** The catalog's functions (GET /api/v1/functions), or null if they cannot be listed. */
    this.functions = functions;
    this.functionsError = functionsError;
    this.connectors = new Map(connectors.map((c) => [c.id, c]));
    this.ruleName = rule?.name || "";
    this.version = rule ? rule.version : null;
    this.graph = Graph.fromRule(bus, rule, feeders);
    /** Source node id → its state as saved (RocketMQ sources: edited apart from the rule). */
    this.savedSources = new Map(this.graph.sources().filter((n) => n.data.type === "rocketmq").map((n) => [n.id, clone(n.data)]));
    /** Source node id → {field key: message} of its form. */
    this.sourceErrors = new Map();
    this.selected = this.graph.filter.id;
    /** node id → {field key: message} of settings that do not parse. */
    this.invalid = new Map();
    /** node id → {field key: text} as typed, for settings that do not parse. */
    this.rawText = new Map();
    this.localProblems = [];
    this.serverProblems = [];
    this.generalError = null;
    this.validation = "idle";
    this.dirty = false;
    this.draft = null;
    this.testMarks = new Map();
    this.validateTimer = 0;
    this.validateAbort = null;
    this.connecting = null;
    this.scale = 1;
    this.onResize = () => this.sizeCanvas();
    window.addEventListener("resize", this.onResize);
  }

  get isNew() {
    return this.version === null;
  }

  /** The app asks before navigating away. */
  leaveWarning() {
    if (this.dirty) return "The channel has changes that are not saved. Leave the builder anyway?";
    const source = this.graph.sources().find((n) => this.sourceChanged(n));
    return source ? `Source ${source.data.name} has changes that are not saved. Leave the builder anyway?` : null;
  }

  destroy() {
    window.removeEventListener("resize", this.onResize);
    clearTimeout(this.validateTimer);
    this.validateAbort?.abort();
  }

  // -------------------------------------------------------------------------------------
  // Layout

  render() {
    const titleId = uid("builder-title");
    this.nameInput = h("input", {
      class: "input input--name",
      value: this.ruleName,
      placeholder: "e.g. orders-to-billing",
      autocomplete: "off",
      spellcheck: "false",
      disabled: !this.isNew,
      on: { input: () => this.changed({ structure: false }) },
    });
    this.nameField = field("Rule name", this.nameInput, { hint: this.isNew ? "Letters, digits, -, _ and ." : "Renaming: save as a new rule, then delete this one." });
    // The visible state follows every key; screen readers hear only outcomes (valid, problems).
    this.statusEl = h("p", { class: "validation" });
    this.statusLive = h("p", { class: "visually-hidden", role: "status" });
    this.saveButton = button("Save", () => this.save(), { class: "button button--primary", title: "Save the rule (Ctrl+S)" });
    this.problemsEl = h("div", { class: "problems", hidden: true });
    this.bannerEl = h("div", { class: "builder__banner" });

    this.canvas = h("div", { class: "canvas", on: { dragover: (e) => this.onDragOver(e), dragleave: () => this.canvas.classList.remove("is-drop-target"), drop: (e) => this.onDrop(e) } });
    this.edgesEl = svg("svg", { class: "edges", "aria-hidden": "true" });
    this.nodesEl = h("div", { class: "nodes" });
    this.canvas.append(this.edgesEl, this.nodesEl);
    this.sizer = h("div", { class: "canvas-sizer" }, this.canvas);
    this.canvasWrap = h("div", { class: "canvas-wrap", role: "region", "aria-label": "Channel graph" }, this.sizer);
    this.zoomLabel = h("output", { class: "zoom__level", "aria-live": "polite", text: "100%" });
    const zoom = h(
      "div",
      { class: "zoom", role: "group", "aria-label": "Zoom" },
      button("−", () => this.zoom(-1), { class: "button button--small", "aria-label": "Zoom out", title: "Zoom out" }),
      this.zoomLabel,
      button("+", () => this.zoom(1), { class: "button button--small", "aria-label": "Zoom in", title: "Zoom in" }),
      button("Fit", () => this.fit(), { class: "button button--small", title: "Show the whole channel" }),
    );

    this.inspector = h("aside", { class: "inspector", "aria-labelledby": "inspector-title" });

    replace(
      this.root,
      h(
        "section",
        { class: "builder", "aria-labelledby": titleId, on: { keydown: (e) => this.shortcut(e) } },
        h(
          "header",
          { class: "builder__bar" },
          h(
            "div",
            { class: "builder__title" },
            h("nav", { class: "crumbs", "aria-label": "Breadcrumb" }, h("a", { href: "#/channels", text: "Channels" }), h("span", { "aria-hidden": "true", text: "/" }), clip(this.bus)),
            h("h1", { id: titleId, class: "view-title" }, this.isNew ? "New rule" : clip(this.ruleName)),
          ),
          this.nameField,
          h(
            "div",
            { class: "builder__actions" },
            this.statusEl,
            this.statusLive,
            zoom,
            button("Tidy layout", () => this.tidy(), { class: "button", title: "Place the nodes in columns again" }),
            this.isNew ? null : button("Reload", () => this.reload(), { class: "button", title: "Load the rule as saved" }),
            this.saveButton,
          ),
        ),
        this.bannerEl,
        this.problemsEl,
        h("div", { class: "builder__main" }, this.renderPalette(), this.canvasWrap, this.inspector),
        this.renderTester(),
      ),
    );
    this.renderCanvas();
    this.renderInspector();
    this.validate();
    // A wide channel starts zoomed out, but not so far that its text is unreadable.
    requestAnimationFrame(() => {
      if (this.contentSize().width > this.canvasWrap.clientWidth) {
        this.fit();
        if (this.scale < 0.65) this.setScale(0.65);
      }
    });
  }

  contentSize() {
    let width = 0;
    let height = 0;
    for (const n of this.graph.nodes.values()) {
      width = Math.max(width, n.x + COLUMN);
      height = Math.max(height, n.y + ROW + 40);
    }
    return { width, height };
  }

  setScale(scale) {
    this.scale = Math.min(1.5, Math.max(0.4, Math.round(scale * 100) / 100));
    setText(this.zoomLabel, `${Math.round(this.scale * 100)}%`);
    this.sizeCanvas();
  }

  zoom(direction) {
    const steps = [0.4, 0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5];
    const next = direction > 0 ? steps.find((s) => s > this.scale + 0.001) : [...steps].reverse().find((s) => s < this.scale - 0.001);
    this.setScale(next ?? this.scale);
  }

  /** The whole channel in view (never larger than 100%). */
  fit() {
    const { width, height } = this.contentSize();
    const wrap = this.canvasWrap;
    this.setScale(Math.min(1, (wrap.clientWidth - 8) / width, (wrap.clientHeight - 8) / height));
    wrap.scrollTo(0, 0);
  }

  shortcut(e) {
    if ((e.ctrlKey || e.metaKey) && e.key === "s") {
      e.preventDefault();
      this.save();
    }
  }

  renderPalette() {
    const item = (kind, value, title, info) =>
      h(
        "li",
        {
          class: ["palette__item", `palette__item--${kind}`],
          draggable: "true",
          title: `${info}. Drag onto the canvas.`,
          dataset: { kind, value },
          on: {
            dragstart: (e) => {
              e.dataTransfer.setData(DRAG_TYPE, JSON.stringify({ kind, value }));
              e.dataTransfer.setData("text/plain", `${kind}:${value}`);
              e.dataTransfer.effectAllowed = "copy";
            },
          },
        },
        h("span", { class: "palette__grip", "aria-hidden": "true" }),
        h("span", { class: "palette__text" }, h("span", { class: "palette__name", text: title }), h("span", { class: "palette__info", text: info })),
        button("Add", () => this.addFromPalette(kind, value), {
          class: "button button--small palette__add",
          "aria-label": `Add ${kind === "step" ? `a ${title} step` : `a ${title} target`} after the selected node`,
        }),
      );
    return h(
      "aside",
      { class: "palette", "aria-labelledby": "palette-title" },
      h("h2", { id: "palette-title", class: "panel-title", text: "Palette" }),
      h("p", { class: "palette__hint", text: "Drag onto the canvas, or press Add to put it after the selected node." }),
      h("h3", { class: "palette__group", text: "Transform steps" }),
      h("ul", { class: "palette__list" }, STEP_FORMS.map((form) => item("step", form, stepTitle(form), STEP_INFO[form]))),
      h("h3", { class: "palette__group", text: "Targets" }),
      h("ul", { class: "palette__list" }, TARGET_TYPES.map((type) => item("target", type, type, TARGET_INFO[type]))),
    );
  }

  // -------------------------------------------------------------------------------------
  // The canvas

  renderCanvas() {
    const nodes = [...this.graph.nodes.values()];
    keyed(
      this.nodesEl,
      nodes,
      (n) => n.id,
      (n) => this.createNode(n),
      (el, n) => this.updateNode(el, n),
    );
    this.sizeCanvas();
    this.renderEdges();
  }

  /** The canvas covers the content and the visible area; the sizer gives the wrap its scrolled size. */
  sizeCanvas() {
    const content = this.contentSize();
    const s = this.scale;
    const width = Math.max(content.width, (this.canvasWrap.clientWidth - 2) / s);
    const height = Math.max(content.height, (this.canvasWrap.clientHeight - 2) / s);
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    this.canvas.style.transform = s === 1 ? "" : `scale(${s})`;
    this.sizer.style.width = `${width * s}px`;
    this.sizer.style.height = `${height * s}px`;
  }

  createNode(node) {
    const el = h("div", { class: ["node", `node--${node.kind}`], role: "group", dataset: { id: node.id } });
    const body = h("button", {
      type: "button",
      class: "node__body",
      id: `${node.id}-body`,
      on: {
        click: () => {
          if (this.suppressClick) return;
          this.select(node.id);
        },
        pointerdown: (e) => this.startMove(e, node.id),
        keydown: (e) => this.nodeKey(e, node.id),
      },
    });
    append(body, [h("span", { class: "node__kind" }), h("span", { class: "node__title clip" }), h("span", { class: "node__meta clip" })]);
    const status = h("span", { class: "node__status" });
    const error = h("span", { class: "node__error clip", id: `${node.id}-error` });
    el.append(body, status, error);
    if (Graph.hasInput(node)) {
      el.prepend(
        h("button", {
          type: "button",
          class: "port port--in",
          dataset: { port: "in" },
          on: { click: () => this.select(node.id, { focus: "input" }) },
        }),
      );
    }
    if (Graph.hasOutput(node)) {
      el.append(
        h("button", {
          type: "button",
          class: "port port--out",
          dataset: { port: "out" },
          on: {
            pointerdown: (e) => this.startConnect(e, node.id),
            click: () => {
              if (this.suppressClick) return;
              this.select(node.id, { focus: "output" });
            },
          },
        }),
      );
    }
    return el;
  }

  updateNode(el, node) {
    el.style.left = `${node.x}px`;
    el.style.top = `${node.y}px`;
    const { kind, title, meta } = caption(this.graph, node);
    const problems = this.problemsOf(node.id);
    const mark = this.testMarks.get(node.id);
    el.classList.toggle("is-selected", node.id === this.selected);
    el.classList.toggle("has-error", problems.length > 0);
    for (const state of ["pass", "fail", "skip"]) el.classList.toggle(`test-${state}`, mark?.state === state);
    el.setAttribute("aria-label", `${kind}: ${title}`);
    const body = el.querySelector(".node__body");
    body.setAttribute("aria-pressed", String(node.id === this.selected));
    body.setAttribute("aria-describedby", `${node.id}-error`);
    setText(body.querySelector(".node__kind"), kind);
    setText(body.querySelector(".node__title"), title);
    setText(body.querySelector(".node__meta"), meta);
    const error = el.querySelector(".node__error");
    setText(error, problems.length ? `${problems.length > 1 ? `${problems.length} problems: ` : ""}${problems[0].message}` : "");
    error.hidden = !problems.length;
    const status = el.querySelector(".node__status");
    status.replaceChildren();
    if (mark) status.append(h("span", { class: `test-mark test-mark--${mark.state}`, title: mark.text, text: mark.short }));
    if (node.kind === "source" && this.sourceChanged(node)) status.append(h("span", { class: "badge badge--warn", title: "Its settings have changes that are not saved", text: "not saved" }));
    if (node.kind === "target" && !this.isNew) {
      const connector = this.connectors.get(`${this.bus}/${this.ruleName}/${node.data.name}`);
      if (connector) status.append(badge(connector.state, { title: `${connector.reason ? `${connector.reason} · ` : ""}${count(connector.lag)} events behind` }));
    }
    const inPort = el.querySelector(".port--in");
    if (inPort) inPort.setAttribute("aria-label", `Input of ${label(node)}: choose what feeds it`);
    const outPort = el.querySelector(".port--out");
    if (outPort) outPort.setAttribute("aria-label", `Output of ${label(node)}: drag to an input, or press to connect it`);
  }

  renderEdges() {
    const edges = this.edgesEl;
    edges.replaceChildren();
    const markerId = "edge-arrow";
    const defs = svg("defs");
    const marker = svg("marker", { id: markerId, viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" });
    marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "edge-arrow" }));
    defs.append(marker);
    edges.append(defs);
    for (const edge of this.graph.edges) {
      const from = this.anchor(edge.from, "out");
      const to = this.anchor(edge.to, "in");
      if (!from || !to) continue;
      const active = edge.from === this.selected || edge.to === this.selected;
      edges.append(svg("path", { d: curve(from, to), class: `edge${active ? " is-active" : ""}`, "marker-end": `url(#${markerId})` }));
    }
    if (this.connecting?.point) {
      const from = this.anchor(this.connecting.from, "out");
      edges.append(svg("path", { d: curve(from, this.connecting.point), class: "edge edge--draft" }));
    }
  }

  /** Where a node's port is on the canvas. */
  anchor(id, port) {
    const node = this.graph.get(id);
    const el = this.nodesEl.querySelector(`[data-id="${id}"]`);
    if (!node || !el) return null;
    return { x: node.x + (port === "out" ? el.offsetWidth : 0), y: node.y + el.offsetHeight / 2 };
  }

  canvasPoint(e) {
    const rect = this.canvas.getBoundingClientRect();
    return { x: (e.clientX - rect.left) / this.scale, y: (e.clientY - rect.top) / this.scale };
  }

  /** Moving a node with the pointer (a press without movement is a click: select). */
  startMove(e, id) {
    if (e.button !== 0) return;
    const node = this.graph.get(id);
    const start = this.canvasPoint(e);
    const origin = { x: node.x, y: node.y };
    const target = e.currentTarget;
    let moved = false;
    target.setPointerCapture(e.pointerId);
    const move = (ev) => {
      const p = this.canvasPoint(ev);
      if (!moved && Math.hypot(p.x - start.x, p.y - start.y) < 5) return;
      moved = true;
      node.x = Math.max(0, Math.round(origin.x + p.x - start.x));
      node.y = Math.max(0, Math.round(origin.y + p.y - start.y));
      this.updateNode(this.nodesEl.querySelector(`[data-id="${id}"]`), node);
      this.renderEdges();
    };
    const up = () => {
      target.removeEventListener("pointermove", move);
      target.removeEventListener("pointerup", up);
      target.removeEventListener("pointercancel", up);
      if (moved) {
        this.sizeCanvas();
        this.suppressClick = true;
        setTimeout(() => (this.suppressClick = false));
      }
    };
    target.addEventListener("pointermove", move);
    target.addEventListener("pointerup", up);
    target.addEventListener("pointercancel", up);
  }

  /** Dragging from an output port to a node's input. */
  startConnect(e, fromId) {
    if (e.button !== 0) return;
    e.preventDefault();
    const port = e.currentTarget;
    port.setPointerCapture(e.pointerId);
    const start = this.canvasPoint(e);
    this.connecting = { from: fromId, point: null };
    this.canvas.classList.add("is-connecting");
    for (const el of this.nodesEl.querySelectorAll(".node")) {
      el.classList.toggle("can-drop", this.graph.canConnect(fromId, el.dataset.id).ok);
    }
    const move = (ev) => {
      const p = this.canvasPoint(ev);
      if (!this.connecting.point && Math.hypot(p.x - start.x, p.y - start.y) < 5) return;
      this.connecting.point = p;
      this.renderEdges();
    };
    const up = (ev) => {
      port.removeEventListener("pointermove", move);
      port.removeEventListener("pointerup", up);
      port.removeEventListener("pointercancel", up);
      const dragged = Boolean(this.connecting.point);
      this.connecting = null;
      this.canvas.classList.remove("is-connecting");
      for (const el of this.nodesEl.querySelectorAll(".can-drop")) el.classList.remove("can-drop");
      if (dragged) {
        this.suppressClick = true;
        setTimeout(() => (this.suppressClick = false));
        const hit = document.elementFromPoint(ev.clientX, ev.clientY)?.closest(".node");
        if (hit && hit.dataset.id !== fromId) this.connect(fromId, hit.dataset.id);
        else if (ev.type === "pointerup") announce("Not connected: drop the connection on a step or a target.");
      }
      this.renderEdges();
    };
    port.addEventListener("pointermove", move);
    port.addEventListener("pointerup", up);
    port.addEventListener("pointercancel", up);
  }

  nodeKey(e, id) {
    const node = this.graph.get(id);
    const step = e.shiftKey ? 64 : 16;
    const moves = { ArrowLeft: [-step, 0], ArrowRight: [step, 0], ArrowUp: [0, -step], ArrowDown: [0, step] };
    if (moves[e.key]) {
      e.preventDefault();
      node.x = Math.max(0, node.x + moves[e.key][0]);
      node.y = Math.max(0, node.y + moves[e.key][1]);
      this.renderCanvas();
    } else if (e.key === "Delete" || e.key === "Backspace") {
      e.preventDefault();
      this.removeNode(id);
    }
  }

  onDragOver(e) {
    if (!e.dataTransfer.types.includes(DRAG_TYPE)) return;
    e.preventDefault();
    e.dataTransfer.dropEffect = "copy";
    this.canvas.classList.add("is-drop-target");
  }

  onDrop(e) {
    this.canvas.classList.remove("is-drop-target");
    const raw = e.dataTransfer.getData(DRAG_TYPE);
    if (!raw) return;
    e.preventDefault();
    const { kind, value } = JSON.parse(raw);
    const p = this.canvasPoint(e);
    this.addNode(kind, value, { x: Math.max(0, Math.round(p.x - 100)), y: Math.max(0, Math.round(p.y - 36)) });
  }

  // -------------------------------------------------------------------------------------
  // Editing the graph

  addFromPalette(kind, value) {
    const selected = this.graph.get(this.selected);
    const from = selected && Graph.hasOutput(selected) ? selected : null;
    this.addNode(kind, value, { from });
  }

  addNode(kind, value, { from = null, x, y } = {}) {
    const data = kind === "step" ? newStep(value) : newTarget(value, this.uniqueTargetName(value));
    const node = this.graph.add(kind, data);
    if (x !== undefined) {
      node.x = x;
      node.y = y;
    } else {
      const base = from || this.graph.filter;
      node.x = base.x + COLUMN;
      node.y = base.y;
      while ([...this.graph.nodes.values()].some((n) => n !== node && Math.abs(n.x - node.x) < COLUMN - 40 && Math.abs(n.y - node.y) < ROW - 20)) node.y += ROW;
    }
    let how = "";
    if (from) {
      try {
        // A step added after a node with outputs goes between it and them.
        const children = kind === "step" ? this.graph.childrenOf(from.id) : [];
        this.graph.connect(from.id, node.id);
        for (const child of children) this.graph.connect(node.id, child.id);
        how = ` after ${label(from)}`;
        if (children.length) this.graph.layout();
      } catch (err) {
        how = ` (not connected: ${err.message})`;
      }
    }
    this.selected = node.id;
    this.changed();
    this.renderInspector();
    const el = this.nodesEl.querySelector(`[data-id="${node.id}"]`);
    el?.scrollIntoView({ block: "nearest", inline: "nearest" });
    el?.querySelector(".node__body").focus();
    announce(`Added ${label(node)}${how}.`);
  }

  uniqueTargetName(type) {
    const names = new Set(this.graph.targets().map((t) => t.data.name));
    let n = names.size + 1;
    while (names.has(`${type}-${n}`)) n += 1;
    return `${type}-${n}`;
  }

  connect(fromId, toId) {
    const check = this.graph.canConnect(fromId, toId);
    if (!check.ok) {
      announce(`Not connected: ${check.reason}.`, "error");
      return false;
    }
    this.graph.connect(fromId, toId);
    this.changed();
    this.renderInspector();
    announce(`Connected ${label(this.graph.get(fromId))} to ${label(this.graph.get(toId))}.`);
    return true;
  }

  disconnect(toId) {
    const parent = this.graph.parentOf(toId);
    this.graph.disconnect(toId);
    this.changed();
    this.renderInspector();
    announce(`Disconnected ${label(this.graph.get(toId))} from ${label(parent)}.`);
  }

  removeNode(id) {
    const node = this.graph.get(id);
    if (!node || node.kind === "source" || node.kind === "filter") {
      announce("The source and the filter are part of every rule: they cannot be removed.");
      return;
    }
    const parent = this.graph.parentOf(id);
    this.graph.remove(id);
    this.invalid.delete(id);
    this.rawText.delete(id);
    this.selected = parent?.id || this.graph.filter.id;
    this.changed();
    this.renderInspector();
    this.nodesEl.querySelector(`[data-id="${this.selected}"] .node__body`)?.focus();
    announce(`Removed ${label(node)}.`);
  }

  select(id, { focus } = {}) {
    this.selected = id;
    this.renderCanvas();
    this.renderInspector();
    if (focus === "input") this.inspector.querySelector("[data-connect=input]")?.focus();
    else if (focus === "output") this.inspector.querySelector("[data-connect=output]")?.focus();
  }

  tidy() {
    this.graph.layout();
    this.renderCanvas();
    announce("Nodes placed in columns.");
  }

  /** Something changed: redraw, forget test results, check again soon. */
  changed({ structure = true } = {}) {
    this.dirty = true;
    this.testMarks.clear();
    if (structure) this.renderCanvas();
    this.scheduleValidate();
  }

  // -------------------------------------------------------------------------------------
  // The side form

  renderInspector() {
    const node = this.graph.get(this.selected) || this.graph.filter;
    const { kind, title } = caption(this.graph, node);
    const body = h("div", { class: "inspector__body" });
    const general = this.problemsOf(node.id).filter((p) => !p.field || !fieldKeys(node).has(p.field));
    replace(
      this.inspector,
      h("h2", { id: "inspector-title", class: "panel-title" }, h("span", { class: "panel-title__kind", text: kind }), clip(title)),
      general.length ? h("ul", { class: "inspector__errors" }, general.map((p) => h("li", { text: p.message }))) : null,
      body,
    );
    if (node.kind === "source") this.sourceForm(body, node);
    else if (node.kind === "filter") this.filterForm(body, node);
    else if (node.kind === "step") this.stepForm(body, node);
    else this.targetForm(body, node);
    if (node.kind !== "source") body.append(this.connectionsForm(node));
    if (node.kind === "step" || node.kind === "target") {
      body.append(h("div", { class: "inspector__danger" }, button(`Remove this ${node.kind}`, () => this.removeNode(node.id), { class: "button button--danger" })));
    }
  }

  sourceForm(body, node) {
    const d = node.data;
    if (d.type === "webhook") this.webhookForm(body, node);
    else if (d.type === "rocketmq") this.rocketmqForm(body, node);
    else if (d.type && d.type !== "ingress") body.append(h("p", { class: "muted", text: `A ${d.type} source: not editable here.` }), h("pre", { class: "code", text: json(d) }));
    else this.ingressForm(body);
    body.append(this.feedersList(node));
  }

  ingressForm(body) {
    const b = this.busResource;
    append(body, [
      h(
        "dl",
        { class: "facts" },
        fact("Bus", clip(b.name)),
        fact("Shards", count(b.shards)),
        fact(
          "Retention",
          b.retention || b.retention_bytes
            ? [b.retention ? duration(b.retention) : null, b.retention_bytes ? `at most ${bytes(b.retention_bytes)}` : null].filter(Boolean).join(", ")
            : "none (events go once every subscription passed them)",
        ),
        fact("Undelivered events kept", `${b.max_backlog_age ? duration(b.max_backlog_age) : "a week (default)"}, then skipped by the subscription holding them`),
        fact("Deduplication", b.dedup_window ? duration(b.dedup_window) : "off"),
        fact("Producers post to", clip(`POST /buses/${b.name}/events`)),
      ),
      h("p", {}, h("a", { href: `#/events/${encodeURIComponent(b.name)}`, text: "Recent events of this bus" })),
    ]);
  }

  webhookForm(body, node) {
    const d = node.data;
    append(body, [
      h(
        "dl",
        { class: "facts" },
        fact("Webhook source", clip(d.name)),
        fact("Into bus", clip(d.bus)),
        fact("Verified by", d.preset ? h("code", { text: d.preset }) : "—"),
        fact("Providers post to", clip(`POST ${d.path}`)),
        fact("Events' source", clip(d.path)),
        fact("Declared in", d.origin === "catalog" ? "the catalog (every replica)" : "this replica's configuration file"),
        ...(d.unavailable ? [fact("Unavailable here", clip(d.unavailable))] : []),
      ),
      h("p", { class: "callout source-hint" }, "Read-only here: a webhook source comes from a replica's configuration file (", h("code", { text: "[[webhooks]]" }), ") or from the catalog (", h("code", { text: "PUT /api/v1/webhooks/{name}" }), " or ", h("code", { text: "sluice ctl apply" }), ", with ", h("code", { text: "env:" }), " secrets). Secrets are never shown."),
    ]);
  }

  /** A RocketMQ source's settings, saved apart from the rule (PUT /api/v1/sources/{name}, If-Match). */
  rocketmqForm(body, node) {
    const d = node.data;
    const saved = this.savedSources.get(node.id);
    const errors = this.sourceErrors.get(node.id) || {};
    this.sourceErrors.set(node.id, errors);
    const form = h("form", { class: "source-form", novalidate: true, "aria-label": `RocketMQ source ${d.name}` });
    const status = h("p", { class: "source-form__status", role: "status" });
    const saveButton = h("button", { type: "submit", class: "button button--primary", text: "Save source" });
    const undoButton = button("Undo changes", () => {
      node.data = clone(saved);
      this.sourceErrors.delete(node.id);
      this.renderCanvas();
      this.renderInspector();
      announce(`Changes to source ${d.name} undone.`);
    }, { class: "button" });
    const refresh = () => {
      const changed = this.sourceChanged(node);
      saveButton.disabled = !changed;
      undoButton.disabled = !changed;
      setText(status, changed ? "Changed: not saved yet" : `Saved · version ${saved?.version ?? "—"}`);
      status.dataset.state = changed ? "changed" : "saved";
    };
    const wrappers = {};
    for (const spec of ROCKETMQ_SOURCE_FIELDS) {
      const value = d[spec.key];
      const control = h("input", {
        class: "input",
        type: "text",
        autocomplete: "off",
        spellcheck: "false",
        inputmode: spec.integer ? "numeric" : undefined,
        placeholder: spec.placeholder,
        required: Boolean(spec.required),
        value: errors[spec.key]?.raw ?? (value === undefined || value === null ? "" : String(value)),
        dataset: { sourceField: spec.key },
        on: {
          input: () => {
            const text = control.value.trim();
            let message = null;
            if (spec.integer) {
              if (text === "") delete d[spec.key];
              else if (/^\d+$/.test(text)) d[spec.key] = Number(text);
              else message = "A whole number.";
            } else if (text === "" && !spec.required) delete d[spec.key];
            else d[spec.key] = text;
            if (!message && spec.required && text === "") message = `${spec.label} is required.`;
            if (message) errors[spec.key] = { message, raw: control.value };
            else delete errors[spec.key];
            setFieldError(wrappers[spec.key], message);
            refresh();
            this.renderCanvasSoon();
          },
        },
      });
      wrappers[spec.key] = field(spec.label + (spec.required ? " *" : ""), control, { hint: spec.hint });
      if (errors[spec.key]) setFieldError(wrappers[spec.key], errors[spec.key].message);
      form.append(wrappers[spec.key]);
    }
    form.append(h("div", { class: "field-row source-form__actions" }, saveButton, undoButton, status));
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      const bad = Object.keys(errors);
      if (bad.length) {
        announce(`Source ${d.name} not saved: ${errors[bad[0]].message}`, "error");
        form.querySelector(`[data-source-field="${bad[0]}"]`)?.focus();
        return;
      }
      saveButton.disabled = true;
      setText(status, "Saving…");
      try {
        const answer = await api.putSource(d.name, api.withoutVersion(d), saved?.version);
        const resource = answer.data && typeof answer.data === "object" ? answer.data : { ...d, version: Number(answer.etag) };
        node.data = clone(resource);
        this.savedSources.set(node.id, clone(resource));
        this.sourceErrors.delete(node.id);
        this.renderCanvas();
        if (this.selected === node.id) this.renderInspector();
        announce(`Saved source ${d.name} (version ${resource.version}): it consumes topic ${resource.topic} within about a second.`, "ok");
      } catch (err) {
        if (err.isAuth) {
          refresh();
          return;
        }
        // The field at fault: the problem's pointer, else the setting its message names.
        const detail = err.detail.replace(/^source `[^`]*`: /, "");
        const key = [(err.pointer || "").split("/").filter(Boolean)[0], ...[...detail.matchAll(/`([a-z_]+)`/g)].map((m) => m[1])].find((k) => k && wrappers[k]);
        if (err.status === 400 && key) {
          errors[key] = { message: detail, raw: form.querySelector(`[data-source-field="${key}"]`).value };
          setFieldError(wrappers[key], detail);
        }
        const text =
          err.status === 412
            ? `Someone else changed source ${d.name} after it was loaded: reload it to get their version (your changes here would be lost).`
            : detail;
        replace(status, h("span", { class: "is-error", text: `Not saved: ${text}` }), err.status === 412 ? [" ", button("Reload the source", () => this.reloadSource(node), { class: "button button--small" })] : null);
        status.dataset.state = "error";
        saveButton.disabled = false;
        announce(`Source ${d.name} not saved: ${text}`, "error");
      }
    });
    const connector = this.connectors.get(`source/${d.name}`);
    append(body, [
      h("dl", { class: "facts" }, fact("RocketMQ source", clip(d.name)), fact("Into bus", clip(d.bus)), connector ? fact("State", [badge(connector.state), " ", h("span", { class: "muted", text: `${count(connector.lag)} behind` })]) : null),
      form,
      h("p", { class: "muted" }, "Saved on its own (not with the rule), and takes effect at once. ", h("a", { href: "#/cluster", text: "Pause, resume or restart it in the cluster view" }), "."),
    ]);
    refresh();
  }

  async reloadSource(node) {
    try {
      const { data } = await api.getSource(node.data.name);
      node.data = clone(data);
      this.savedSources.set(node.id, clone(data));
      this.sourceErrors.delete(node.id);
      this.renderCanvas();
      if (this.selected === node.id) this.renderInspector();
      announce(`Source ${data.name} reloaded (version ${data.version}).`);
    } catch (err) {
      if (!err.isAuth) announce(`Source ${node.data.name} cannot be reloaded: ${err.detail}`, "error");
    }
  }

  /** Whether a RocketMQ source's form holds changes not saved. */
  sourceChanged(node) {
    const saved = this.savedSources.get(node.id);
    if (!saved) return false;
    return Object.keys(this.sourceErrors.get(node.id) || {}).length > 0 || canonical(api.withoutVersion(node.data)) !== canonical(api.withoutVersion(saved));
  }

  /** Every source feeding the bus, and what that means for the rule. */
  feedersList(node) {
    const sources = this.graph.sources();
    return h(
      "fieldset",
      { class: "group" },
      h("legend", { text: `All sources of bus ${this.bus} (${sources.length})` }),
      h(
        "ul",
        { class: "links feeders" },
        sources.map((n) =>
          h(
            "li",
            { class: n.id === node.id ? "is-current" : null },
            n.id === node.id ? h("strong", { text: describe(this.graph, n) }) : button(describe(this.graph, n), () => this.select(n.id), { class: "link-button", title: "Select it" }),
            h("span", { class: "muted feeders__attr", text: `events' source: ${sourceAttribute(n.data)}` }),
          ),
        ),
      ),
      h(
        "p",
        { class: "callout source-hint" },
        `The rule applies to every event of bus ${this.bus}, whichever source stored it${sources.length > 1 ? ` (all ${sources.length} of them)` : ""}. To take one source's events only, match their source attribute in the filter, e.g. `,
        h("code", { text: `{"source": ["${sources.find((n) => n.data.type === "webhook")?.data.path || "/webhooks/github"}"]}` }),
        ".",
      ),
    );
  }

  filterForm(body, node) {
    const data = node.data;
    const name = uid("mode");
    const modes = [
      ["all", "Every event"],
      ["pattern", "Event pattern (JSON)"],
      ["filter", "CESQL expression"],
    ];
    const fieldset = h("fieldset", { class: "choices" }, h("legend", { text: "Which events this rule takes" }));
    for (const [value, text] of modes) {
      const input = h("input", {
        type: "radio",
        name,
        value,
        checked: data.mode === value,
        on: {
          change: () => {
            data.mode = value;
            this.changed();
            this.renderInspector();
            this.inspector.querySelector(`input[value="${value}"]`)?.focus();
          },
        },
      });
      fieldset.append(field(text, input));
    }
    body.append(fieldset);
    if (data.mode === "pattern") {
      const area = h("textarea", { class: "input input--code", rows: 10, spellcheck: "false", value: data.pattern, dataset: { field: "pattern" } });
      const f = field("Pattern", area, { hint: 'Attribute → accepted values, e.g. {"type": ["a", "b"], "data": {"total": [{"numeric": [">", 100]}]}}. See functions/README.md.', wide: true });
      area.addEventListener("input", () => {
        data.pattern = area.value;
        this.changed({ structure: false });
        this.renderCanvasSoon();
      });
      body.append(f);
      this.showFieldError(f, node, "pattern");
    } else if (data.mode === "filter") {
      const area = h("textarea", { class: "input input--code", rows: 4, spellcheck: "false", value: data.filter, dataset: { field: "filter" } });
      const f = field("CESQL", area, { hint: "e.g. type LIKE 'com.example.%' AND EXISTS subject. A filter matches when it is true without errors.", wide: true });
      area.addEventListener("input", () => {
        data.filter = area.value;
        this.changed({ structure: false });
        this.renderCanvasSoon();
      });
      body.append(f);
      this.showFieldError(f, node, "filter");
    } else {
      body.append(h("p", { class: "muted", text: "The rule takes every event of the bus." }));
    }
  }

  stepForm(body, node) {
    const data = node.data;
    const path = this.pathIndex(node);
    const formSelect = select(STEP_FORMS.map((f) => [f, stepTitle(f)]), data.form, {
      class: "input",
      on: {
        change: () => {
          const keep = node.data;
          node.data = { ...newStep(formSelect.value), ...(keep.into && BODY_FORMS.has(formSelect.value) ? { into: keep.into } : {}) };
          this.invalid.delete(node.id);
          this.rawText.delete(node.id);
          this.changed();
          this.renderInspector();
          this.inspector.querySelector("select")?.focus();
        },
      },
    });
    append(body, [field("Form", formSelect, { hint: `${STEP_INFO[data.form] || ""}${path ? ` · step ${path} of its chain` : ""}` })]);
    for (const spec of STEP_FIELDS[data.form] || []) body.append(this.settingField(node, spec));
    if (data.form === "ORIGINAL") body.append(h("p", { class: "muted", text: "Passes the event on unchanged." }));
    if (data.form === "WASM") body.append(this.functionDetails(node));
  }

  /** What the catalog says of a function step's function, and warnings (none listed, not loaded). */
  functionDetails(node) {
    const name = node.data.wasm;
    const list = this.functions;
    const wrap = h("div", { class: "function-info" });
    if (list === null) {
      wrap.append(notice("warn", "The catalog's functions cannot be listed", `${this.functionsError ? `${this.functionsError}. ` : ""}Type the function's name: the check and the test say whether it exists.`));
    } else if (!list.length) {
      wrap.append(noFunctionsNotice());
    } else if (name) {
      const f = list.find((x) => x.name === name);
      if (!f) {
        wrap.append(
          h(
            "div",
            { class: "notice notice--warn", role: "status" },
            h("p", { class: "notice__title", text: `Function ${name} is not in the catalog` }),
            h("p", { class: "notice__detail" }, "Upload it with ", h("code", { text: `PUT /api/v1/functions/${name}` }), " or ", h("code", { text: "sluice ctl apply" }), " (then refresh the list), or choose another."),
          ),
        );
      } else {
        if (f.loaded?.error) wrap.append(notice("warn", `Function ${name} cannot be loaded on this replica`, f.loaded.error));
        const facts = [
          ["SHA-256", f.sha256 ? h("code", { title: f.sha256, text: shortSha(f.sha256) }) : null],
          ["Size", f.size !== undefined ? bytes(f.size) : null],
          ["Timeout", f.timeout !== undefined ? duration(f.timeout) : null],
          ["Max memory", f.max_memory_bytes !== undefined ? bytes(f.max_memory_bytes) : null],
          ["Max events returned", f.max_events !== undefined ? count(f.max_events) : null],
          ["Max output", f.max_output_bytes !== undefined ? bytes(f.max_output_bytes) : null],
          ["On this replica", loadedText(f)],
        ].filter(([, v]) => v !== null);
        wrap.append(h("dl", { class: "facts" }, facts.map(([term, value]) => fact(term, value))));
      }
    }
    wrap.append(
      h(
        "p",
        {},
        button("Refresh the list", () => this.refreshFunctions(), { class: "button button--small", title: "List the catalog's functions again", dataset: { refreshFunctions: "" } }),
      ),
    );
    return wrap;
  }

  async refreshFunctions() {
    try {
      const answer = await api.functions();
      this.functions = Array.isArray(answer?.items) ? answer.items : [];
      this.functionsError = null;
      announce(`${this.functions.length} function${this.functions.length === 1 ? "" : "s"} in the catalog.`);
    } catch (err) {
      if (err.isAuth) return;
      if (this.functions === null) this.functionsError = err.detail;
      announce(`The functions cannot be listed: ${err.detail}`, "error");
    }
    this.renderCanvas();
    this.renderInspector();
    this.inspector.querySelector("[data-refresh-functions]")?.focus();
    this.scheduleValidate();
  }

  targetForm(body, node) {
    const data = node.data;
    append(body, [
      h("p", { class: "muted", text: TARGET_INFO[data.type] || data.type }),
      this.settingField(node, { key: "name", label: "Name", kind: "text", required: true, hint: "Unique in the rule: the connector is bus/rule/name." }),
    ]);
    for (const spec of TARGET_FIELDS[data.type] || []) body.append(this.settingField(node, spec));
    if (!LOCAL_TARGETS.has(data.type)) {
      const retry = h("fieldset", { class: "group" }, h("legend", { text: "Retry" }));
      for (const spec of RETRY_FIELDS) retry.append(this.settingField(node, spec));
      body.append(retry, this.deadLetterForm(node));
    }
    const extra = Object.keys(data).filter((k) => !["type", "name", "retry", "dead_letter"].includes(k) && !(TARGET_FIELDS[data.type] || []).some((s) => s.key.split(".")[0] === k));
    if (extra.length) body.append(h("p", { class: "muted", text: `Also kept as loaded: ${extra.join(", ")}.` }));
    if (!this.isNew) {
      const connector = this.connectors.get(`${this.bus}/${this.ruleName}/${data.name}`);
      if (connector) {
        body.append(
          h(
            "fieldset",
            { class: "group" },
            h("legend", { text: "Delivery" }),
            h(
              "dl",
              { class: "facts" },
              fact("State", badge(connector.state)),
              fact("Lag", `${count(connector.lag)} events`),
              connector.worker ? fact("Worker", clip(connector.worker)) : null,
              connector.reason ? fact("Reason", clip(connector.reason)) : null,
            ),
            h("a", { href: "#/cluster", text: "Pause, resume or restart it in the cluster view" }),
          ),
        );
      }
    }
  }

  deadLetterForm(node) {
    const data = node.data;
    const mode = data.dead_letter?.bus !== undefined ? "bus" : data.dead_letter?.target !== undefined ? "target" : "";
    const group = h("fieldset", { class: "group" }, h("legend", { text: "Dead letters" }));
    const modeSelect = select(
      [
        ["", "None: keep retrying at max backoff"],
        ["bus", "Onto a bus"],
        ["target", "To another target"],
      ],
      mode,
      {
        class: "input",
        on: {
          change: () => {
            if (modeSelect.value === "bus") data.dead_letter = { bus: "" };
            else if (modeSelect.value === "target") data.dead_letter = { target: { type: "log", name: `${data.name}-dead-letters` } };
            else delete data.dead_letter;
            this.changed();
            this.renderInspector();
            this.inspector.querySelector("[data-field='dead_letter.mode']")?.focus();
          },
        },
      },
    );
    modeSelect.dataset.field = "dead_letter.mode";
    group.append(field("Undeliverable events go", modeSelect, { hint: "With the extensions deadletterreason, deadletterrule, deadletterstatus, deadletterattempts." }));
    if (mode === "bus") group.append(this.settingField(node, { key: "dead_letter.bus", label: "Dead-letter bus", kind: "bus", required: true }));
    if (mode === "target") group.append(this.settingField(node, { key: "dead_letter.target", label: "Dead-letter target", kind: "object", hint: 'A target, e.g. {"type": "file", "name": "dlq", "path": "{data_dir}/dlq.jsonl"}.' }));
    return group;
  }

  /** One setting of a step or target: its control, bound to `node.data[spec.key]`. */
  settingField(node, spec) {
    const data = node.data;
    if (spec.when && !spec.when(data)) return document.createDocumentFragment();
    const value = getPath(data, spec.key);
    let control;
    const bad = this.invalid.get(node.id)?.[spec.key];
    const shown = bad ? this.rawText.get(node.id)?.[spec.key] ?? "" : displayValue(spec, value);
    const commit = (parsed) => {
      if (spec.resets) {
        if (parsed === undefined) delete data[spec.resets];
        else data[spec.resets] = { type: parsed };
      } else {
        setPath(data, spec.key, parsed);
      }
    };
    const onEdit = (text) => {
      const fields = this.invalid.get(node.id) || {};
      const raw = this.rawText.get(node.id) || {};
      try {
        commit(parseValue(spec, text));
        delete fields[spec.key];
        delete raw[spec.key];
        setFieldError(wrapper, this.serverFieldError(node.id, spec.key));
      } catch (err) {
        fields[spec.key] = err.message;
        raw[spec.key] = text;
        setFieldError(wrapper, err.message);
      }
      if (Object.keys(fields).length) this.invalid.set(node.id, fields);
      else this.invalid.delete(node.id);
      this.rawText.set(node.id, raw);
      this.changed({ structure: false });
      this.renderCanvasSoon();
    };
    switch (spec.kind) {
      case "bool":
        control = h("input", { type: "checkbox", checked: value === true, on: { change: () => onEditValue(control.checked ? true : undefined) } });
        break;
      case "into":
        control = h("input", { type: "checkbox", checked: value === "data", on: { change: () => onEditValue(control.checked ? "data" : undefined) } });
        break;
      case "select":
        control = select(spec.options, value ?? "", { class: "input", on: { change: () => onEditValue(control.value || undefined, true) } });
        break;
      case "bus": {
        const names = this.catalog.buses.map((b) => b.name);
        const options = [["", "Choose a bus…"], ...names.map((n) => [n, n])];
        if (value && !names.includes(value)) options.push([value, `${value} (not in the catalog)`]);
        control = select(options, value ?? "", { class: "input", on: { change: () => onEditValue(control.value || undefined) } });
        break;
      }
      case "function": {
        const list = this.functions;
        if (!list) {
          control = h("input", { class: "input", type: "text", autocomplete: "off", spellcheck: "false", placeholder: "function name", value: value ?? "", on: { input: () => onEditValue(control.value.trim()) } });
          break;
        }
        const options = [["", list.length ? "Choose a function…" : "No functions in the catalog"], ...list.map((f) => [f.name, functionOption(f)])];
        if (value && !list.some((f) => f.name === value)) options.push([value, `${value} (not in the catalog)`]);
        control = select(options, value ?? "", { class: "input", on: { change: () => onEditValue(control.value, true) } });
        break;
      }
      case "object":
      case "json":
      case "text-or-json":
      case "lines":
      case "textarea":
        control = h("textarea", { class: "input input--code", rows: spec.kind === "textarea" ? 4 : 3, spellcheck: "false", value: shown, on: { input: () => onEdit(control.value) } });
        break;
      default:
        control = h("input", {
          class: "input",
          type: spec.kind === "secret" ? "password" : "text",
          inputmode: spec.kind === "integer" ? "numeric" : spec.kind === "number" ? "decimal" : undefined,
          autocomplete: "off",
          spellcheck: "false",
          placeholder: spec.placeholder,
          required: Boolean(spec.required),
          value: shown,
          on: { input: () => onEdit(control.value) },
        });
    }
    control.dataset.field = spec.key;
    if (spec.required && control.tagName !== "INPUT") control.setAttribute("aria-required", "true");
    const wrapper = field(spec.label + (spec.required ? " *" : ""), control, { hint: spec.hint, wide: control.tagName === "TEXTAREA" });
    const self = this;
    function onEditValue(parsed, rerender) {
      commit(parsed);
      self.changed({ structure: false });
      self.renderCanvasSoon();
      if (rerender || spec.resets) {
        self.renderInspector();
        self.inspector.querySelector(`[data-field="${spec.key}"]`)?.focus();
      }
    }
    this.showFieldError(wrapper, node, spec.key);
    if (bad) setFieldError(wrapper, bad);
    return wrapper;
  }

  connectionsForm(node) {
    const group = h("fieldset", { class: "group" }, h("legend", { text: "Connections" }));
    if (Graph.hasInput(node)) {
      const parent = this.graph.parentOf(node.id);
      const candidates = [...this.graph.nodes.values()].filter((n) => n.id === parent?.id || this.graph.canConnect(n.id, node.id).ok);
      const input = select([["", "Not connected"], ...candidates.map((n) => [n.id, describe(this.graph, n)])], parent?.id || "", { class: "input" });
      input.dataset.connect = "input";
      input.addEventListener("change", () => {
        if (input.value) this.connect(input.value, node.id);
        else this.disconnect(node.id);
        this.inspector.querySelector("[data-connect=input]")?.focus();
      });
      group.append(field("Input from", input, { hint: "What feeds this node. Also: drag from an output port onto this node." }));
    }
    if (Graph.hasOutput(node)) {
      const children = this.graph.childrenOf(node.id);
      if (children.length) {
        group.append(
          h("p", { class: "field__label", text: "Feeds" }),
          h(
            "ul",
            { class: "links" },
            children.map((c) =>
              h(
                "li",
                {},
                button(describe(this.graph, c), () => this.select(c.id), { class: "link-button", title: "Select it" }),
                button("Disconnect", () => this.disconnect(c.id), { class: "button button--small", "aria-label": `Disconnect ${label(c)}` }),
              ),
            ),
          ),
        );
      }
      const candidates = [...this.graph.nodes.values()].filter((n) => this.graph.canConnect(node.id, n.id).ok);
      const target = select([["", candidates.length ? "Choose a node…" : "No node can be connected"], ...candidates.map((n) => [n.id, describe(this.graph, n)])], "", { class: "input" });
      target.dataset.connect = "output";
      const go = button("Connect", () => {
        if (!target.value) {
          announce("Choose the node to connect to first.");
          target.focus();
          return;
        }
        const to = target.value;
        if (this.connect(node.id, to)) this.inspector.querySelector("[data-connect=output]")?.focus();
      }, { class: "button" });
      group.append(h("div", { class: "field-row" }, field("Connect output to", target, { hint: "A node with an input takes one; connecting replaces it." }), go));
    }
    return group;
  }

  /** The 1-based place of a step in its chain, if connected. */
  pathIndex(node) {
    const path = this.graph.pathTo(node.id);
    return path ? path.length + 1 : null;
  }

  showFieldError(wrapper, node, key) {
    const message = this.serverFieldError(node.id, key) || this.localFieldError(node.id, key);
    if (message) setFieldError(wrapper, message);
  }

  serverFieldError(id, key) {
    return this.serverProblems.find((p) => p.node === id && p.field === key)?.message || null;
  }

  localFieldError(id, key) {
    return this.localProblems.find((p) => p.node === id && p.field === key)?.message || null;
  }

  /** Node captions follow the form as you type, without redrawing on every key. */
  renderCanvasSoon() {
    cancelAnimationFrame(this.captionFrame);
    this.captionFrame = requestAnimationFrame(() => this.renderCanvas());
  }

  // -------------------------------------------------------------------------------------
  // Validation and saving

  problemsOf(id) {
    return [...this.localProblems, ...this.serverProblems].filter((p) => p.node === id);
  }

  get problems() {
    return [...this.localProblems, ...this.serverProblems];
  }

  scheduleValidate() {
    clearTimeout(this.validateTimer);
    this.setValidation("pending");
    this.validateTimer = setTimeout(() => this.validate(), VALIDATE_DELAY);
  }

  currentName() {
    return this.isNew ? this.nameInput.value.trim() : this.ruleName;
  }

  /** Local checks, then the gateway's own: `POST /catalog/apply?dry_run=true`. */
  async validate() {
    clearTimeout(this.validateTimer);
    this.validateAbort?.abort();
    const draft = this.graph.toRule(this.invalid);
    this.draft = draft;
    this.localProblems = draft.problems;
    this.localProblems.push(...this.requiredProblems());
    const name = this.currentName();
    if (!NAME_PATTERN.test(name)) {
      this.localProblems.push({ node: null, field: "name", message: name ? "A rule name is letters, digits, '-', '_' and '.' (not first), at most 128." : "Give the rule a name." });
    }
    this.setValidation("checking");
    const controller = new AbortController();
    this.validateAbort = controller;
    const body = {
      buses: [api.withoutVersion(this.busResource)],
      rules: [{ name: NAME_PATTERN.test(name) ? name : "untitled", bus: this.bus, ...draft.rule }],
    };
    let server = [];
    let general = null;
    try {
      await api.dryRun(body, controller.signal);
    } catch (err) {
      if (err.name === "AbortError") return;
      if (err.status === 400) server = [this.problemFromRefusal(err, "apply", draft)];
      else general = err;
    }
    if (this.validateAbort !== controller) return;
    this.validateAbort = null;
    // A local problem and the gateway's take on the same field: say it once.
    this.serverProblems = server.filter((s) => !this.localProblems.some((l) => l.node === s.node && l.field === s.field));
    this.generalError = general;
    this.setValidation(general ? "error" : this.problems.length ? "invalid" : "valid");
    this.renderCanvas();
    this.renderProblems();
    this.refreshInspectorErrors();
  }

  /** Settings a step or target needs and does not have. */
  requiredProblems() {
    const problems = [];
    for (const node of this.graph.nodes.values()) {
      let specs = [];
      if (node.kind === "step") specs = STEP_FIELDS[node.data.form] || [];
      else if (node.kind === "target") {
        specs = [...(TARGET_FIELDS[node.data.type] || [])];
        if (node.data.dead_letter?.bus !== undefined) specs.push({ key: "dead_letter.bus", label: "Dead-letter bus", required: true });
      }
      for (const spec of specs) {
        if (!spec.required || (spec.when && !spec.when(node.data)) || this.invalid.get(node.id)?.[spec.key]) continue;
        const value = getPath(node.data, spec.key);
        if (value === undefined || value === null || value === "") problems.push({ node: node.id, field: spec.key, message: spec.requiredMessage || `${spec.label} is required.` });
      }
    }
    return problems;
  }

  /** A 400 answer as a problem at the node at fault. `kind`: apply (pointer in the apply body) or put. */
  problemFromRefusal(err, kind, draft) {
    let pointer = err.pointer ?? "";
    const resource = err.problem.resource || "";
    let message = err.detail.replace(/^(rule|bus|source)\/[^:]*: /, "").replace(/^rule `[^`]*`: /, "");
    if (kind === "apply") {
      if (pointer.startsWith("/rules/0")) pointer = pointer.slice("/rules/0".length);
      else if (pointer.startsWith("/buses/") || resource.startsWith("bus/")) return { node: this.graph.source.id, field: null, message: `The bus as loaded is refused: ${message}` };
      else if (!resource.startsWith("rule/") && pointer) return { node: null, field: null, message };
    }
    let { node, field: key } = this.graph.locate(pointer, message, draft.targetIds);
    if (!node && key !== "name") message = pointer ? `${message} (at ${pointer})` : message;
    const at = node && this.graph.get(node);
    if (at && !key) {
      // The problem is shown at its node: "rule `r`, target `t`: " says nothing more.
      const shortened = message.replace(/^rule `[^`]*`, target `[^`]*`: /, "");
      // "function `f` is not defined": the function step of the target's chain naming it.
      const fn = at.kind === "target" ? functionStep(this.graph.pathTo(node) || [], message) : null;
      if (fn) {
        node = fn.id;
        key = "wasm";
        message = shortened;
      } else if (at.kind === "step" && at.data.form === "WASM") {
        key = "wasm";
        message = shortened;
      } else if (at.kind === "step" && BODY_FORMS.has(at.data.form) && /renders the body/.test(message)) {
        key = "into";
        message = shortened;
      }
    }
    if (node && !key) {
      // "target `t`: url ``: relative URL without a base": the message names the setting.
      message = message.replace(/^target `[^`]*`: /, "");
      const named = message.match(/^`?([a-z_]+(?:\.[a-z_]+)?)`?[ :]/)?.[1];
      if (named && fieldKeys(this.graph.get(node)).has(named)) key = named;
    }
    return { node, field: key, message };
  }

  setValidation(state) {
    this.validation = state;
    const n = this.problems.length;
    const text = {
      idle: "",
      pending: "Editing…",
      checking: "Checking…",
      valid: this.dirty ? "Valid: ready to save" : "Valid",
      invalid: `${n} problem${n === 1 ? "" : "s"}: cannot save yet`,
      error: `Cannot check: ${this.generalError?.detail || "no answer"}`,
    }[state];
    if (this.statusEl) {
      setText(this.statusEl, text);
      this.statusEl.dataset.state = state;
      if (["valid", "invalid", "error"].includes(state)) setText(this.statusLive, text);
    }
    if (this.saveButton) {
      const blocked = state === "invalid";
      this.saveButton.setAttribute("aria-disabled", String(blocked));
      this.saveButton.title = blocked ? "Fix the problems listed first" : "Save the rule (Ctrl+S)";
    }
  }

  renderProblems() {
    const problems = this.problems;
    if (!problems.length) {
      this.problemsEl.replaceChildren();
      this.problemsEl.hidden = true;
      setFieldError(this.nameField, null);
      return;
    }
    this.problemsEl.hidden = false;
    const nameProblem = problems.find((p) => !p.node && p.field === "name");
    setFieldError(this.nameField, nameProblem?.message);
    replace(
      this.problemsEl,
      h("h2", { class: "problems__title", text: `Problems (${problems.length})` }),
      h(
        "ul",
        { class: "problems__list" },
        problems.map((p) => {
          const node = p.node && this.graph.get(p.node);
          const where = node ? describe(this.graph, node) : p.field === "name" ? "Rule name" : "Rule";
          return h(
            "li",
            {},
            button(
              [h("strong", { text: where }), ": ", p.message],
              () => {
                if (node) {
                  this.select(node.id);
                  const control = p.field && this.inspector.querySelector(`[data-field="${CSS.escape(p.field)}"]`);
                  (control || this.nodesEl.querySelector(`[data-id="${node.id}"] .node__body`))?.focus();
                } else if (p.field === "name") this.nameInput.focus();
              },
              { class: "link-button problems__item" },
            ),
          );
        }),
      ),
    );
  }

  /** Errors of the side form after a check, without rebuilding it (focus stays). */
  refreshInspectorErrors() {
    const node = this.graph.get(this.selected);
    if (!node) return;
    for (const control of this.inspector.querySelectorAll("[data-field]")) {
      const key = control.dataset.field;
      const wrapper = control.closest(".field");
      if (!wrapper) continue;
      const message = this.invalid.get(node.id)?.[key] || this.serverFieldError(node.id, key) || this.localFieldError(node.id, key);
      setFieldError(wrapper, message);
    }
    const general = this.problemsOf(node.id).filter((p) => !p.field || !fieldKeys(node).has(p.field));
    const list = this.inspector.querySelector(".inspector__errors");
    if (general.length) {
      const ul = list || h("ul", { class: "inspector__errors" });
      replace(ul, general.map((p) => h("li", { text: p.message })));
      if (!list) this.inspector.querySelector(".panel-title").after(ul);
    } else {
      list?.remove();
    }
  }

  async save() {
    await this.validate();
    if (this.problems.length) {
      announce(`Not saved: fix the ${this.problems.length} problem${this.problems.length === 1 ? "" : "s"} first.`, "error");
      this.problemsEl.querySelector("button")?.focus();
      return;
    }
    if (this.validation === "error") {
      announce(`Not saved: ${this.generalError?.detail}`, "error");
      return;
    }
    const name = this.currentName();
    const draft = this.draft;
    this.saveButton.disabled = true;
    this.bannerEl.replaceChildren();
    try {
      const answer = await api.putRule(this.bus, name, draft.rule, this.version);
      const created = answer.status === 201;
      this.version = answer.data?.version ?? Number(answer.etag);
      this.ruleName = name;
      this.dirty = false;
      this.serverProblems = [];
      this.nameInput.disabled = true;
      this.app.replaceRoute(`#/builder/${encodeURIComponent(this.bus)}/${encodeURIComponent(name)}`);
      setText(this.root.querySelector(".view-title"), name);
      this.setValidation("valid");
      announce(`${created ? "Created" : "Saved"} rule ${name} (version ${this.version}). It takes effect within about a second.`, "ok");
      api.connectors().then(
        (c) => {
          this.connectors = new Map(c.items.map((x) => [x.id, x]));
          this.renderCanvas();
        },
        () => {},
      );
    } catch (err) {
      if (err.status === 400) {
        this.serverProblems = [this.problemFromRefusal(err, "put", draft)];
        this.setValidation("invalid");
        this.renderProblems();
        this.renderCanvas();
        this.refreshInspectorErrors();
        announce(`Not saved: ${err.detail}`, "error");
      } else if (err.status === 412) {
        const text = this.isNew
          ? `A rule named ${name} exists already on bus ${this.bus}. Choose another name, or open that rule.`
          : `Someone else changed rule ${name} after you opened it (you loaded version ${this.version}). Reload to get their version; your changes here would be lost.`;
        replace(this.bannerEl, notice("error", "Not saved: the rule changed", text, this.isNew ? h("a", { class: "button", href: `#/builder/${encodeURIComponent(this.bus)}/${encodeURIComponent(name)}`, text: "Open it" }) : button("Reload", () => this.reload(true), { class: "button" })));
        announce("Not saved: the rule changed meanwhile.", "error");
      } else if (!err.isAuth) {
        replace(this.bannerEl, notice("error", "Not saved", err.detail));
        announce(`Not saved: ${err.detail}`, "error");
      }
    } finally {
      this.saveButton.disabled = false;
    }
  }

  async reload(force = false) {
    if (!force && this.dirty && !(await confirmDialog("Reload the rule?", "Your changes that are not saved would be lost.", { confirmLabel: "Reload" }))) return;
    this.dirty = false;
    this.app.rerender();
  }

  // -------------------------------------------------------------------------------------
  // Testing

  renderTester() {
    this.testEvent = h("textarea", { class: "input input--code", rows: 12, spellcheck: "false", value: json(SAMPLE_EVENT) });
    this.recentSelect = select([["", "Load recent events…"]], "", { class: "input", on: { change: () => this.pickRecent() } });
    this.recentSelect.addEventListener("focus", () => this.loadRecent(), { once: true });
    this.testTarget = h("select", { class: "input" });
    this.testResults = h("div", { class: "test-results" }, h("p", { class: "muted", text: "Run a test to see what each node does with the event." }));
    const details = h(
      "details",
      { class: "tester", on: { toggle: () => details.open && (this.refreshTestTargets(), this.loadRecent()) } },
      h("summary", { class: "tester__summary" }, h("span", { text: "Test with an event" }), h("span", { class: "muted", text: " — the filter and the transform chain of a target, on a sample event" })),
      h(
        "div",
        { class: "tester__grid" },
        h(
          "div",
          { class: "tester__input" },
          field("Recent events of the bus", this.recentSelect),
          field("Event (structured CloudEvent JSON)", this.testEvent, { wide: true }),
          h("div", { class: "field-row" }, field("Chain of target", this.testTarget), button("Run test", () => this.runTest(), { class: "button button--primary" })),
        ),
        this.testResults,
      ),
    );
    return details;
  }

  refreshTestTargets() {
    const current = this.testTarget.value;
    const options = [["", "None: the filter only"], ...this.graph.targets().map((t) => [t.id, `${t.data.name} (${t.data.type})`])];
    const fallback = this.graph.targets()[0]?.id || "";
    replace(this.testTarget, options.map(([v, l]) => h("option", { value: v, text: l, selected: v === (current || fallback) })));
  }

  async loadRecent() {
    if (this.recentLoaded) return;
    this.recentLoaded = true;
    replace(this.recentSelect, h("option", { value: "", text: "Loading recent events…" }));
    try {
      const { items } = await api.recentEvents(this.bus, 20);
      this.recent = items;
      replace(
        this.recentSelect,
        h("option", { value: "", text: items.length ? `${items.length} recent events: choose one…` : "No events on this bus yet" }),
        items.map((item, i) => h("option", { value: String(i), text: `${time(item.accepted_ms)} · ${item.event?.type} · ${item.event?.id}` })),
      );
    } catch (err) {
      this.recentLoaded = false;
      replace(this.recentSelect, h("option", { value: "", text: `Recent events unavailable: ${err.detail}` }));
    }
  }

  pickRecent() {
    const item = this.recent?.[Number(this.recentSelect.value)];
    if (!item) return;
    this.testEvent.value = json(item.event);
    announce(`Event ${item.event?.id} loaded for the test.`);
  }

  async runTest() {
    this.refreshTestTargets();
    let event;
    try {
      event = JSON.parse(this.testEvent.value);
    } catch (err) {
      replace(this.testResults, notice("error", "The event is not valid JSON", err.message));
      this.testEvent.focus();
      return;
    }
    const filter = this.graph.filter;
    const body = { event };
    if (filter.data.mode === "pattern") {
      try {
        body.pattern = JSON.parse(filter.data.pattern || "{}");
      } catch (err) {
        replace(this.testResults, notice("error", "The pattern is not valid JSON", err.message));
        return;
      }
    } else if (filter.data.mode === "filter") {
      body.filter = filter.data.filter;
    }
    const targetId = this.testTarget.value;
    const target = targetId ? this.graph.get(targetId) : null;
    const path = target ? this.graph.pathTo(target.id) : [];
    if (target && !path) {
      replace(this.testResults, notice("error", `Target ${target.data.name} is not connected`, "Connect it to the filter or a step first."));
      return;
    }
    const unchosen = (path || []).findIndex((s) => s.data.form === "WASM" && !s.data.wasm);
    if (unchosen >= 0) {
      replace(this.testResults, notice("error", `Step ${unchosen + 1} calls no function yet`, "Choose its function first."));
      return;
    }
    if (path.length) body.transform = path.map((s) => stepToApi(s.data));
    replace(this.testResults, notice("loading", path.some((s) => s.data.form === "WASM") ? "Testing (the functions may take a moment to load)…" : "Testing…"));
    let result;
    try {
      result = await api.testRule(body);
    } catch (err) {
      if (err.isAuth) return;
      const at = err.pointer || "";
      const fn = functionStep(path, err.detail);
      const node =
        at.startsWith("/pattern") || at.startsWith("/filter")
          ? filter
          : at.startsWith("/transform")
            ? path[Number((err.detail.match(/\bstep (\d+)/) || [])[1])] || fn || target
            : fn;
      this.testMarks.clear();
      if (node) this.testMarks.set(node.id, { state: "fail", short: "✗", text: err.detail });
      this.renderCanvas();
      replace(this.testResults, notice("error", at === "/event" ? "The event is refused" : err.status === 503 ? "The test cannot run now" : "The test is refused", err.detail));
      return;
    }
    this.showTest(event, result, filter, path, target);
  }

  showTest(event, result, filter, path, target) {
    const marks = new Map();
    const rows = [];
    // The source node that would have stored such an event: the one whose events carry its
    // source attribute, else the bus's ingress.
    const from = this.graph.sources().find((n) => n.data.type !== "ingress" && sourceAttribute(n.data) === event?.source) || this.graph.source;
    rows.push(testRow("Source", from === this.graph.source ? `bus ${this.bus}` : label(from), "pass", "The event", event));
    marks.set(from.id, { state: "pass", short: "✓", text: "event in" });
    rows.push(testRow("Filter", filter.data.mode === "all" ? "every event" : filter.data.mode, result.matched ? "pass" : "fail", result.matched ? "Matched: the rule takes this event." : "Not matched: the rule does not take this event."));
    marks.set(filter.id, { state: result.matched ? "pass" : "fail", short: result.matched ? "✓ matched" : "✗ no match", text: result.matched ? "matched" : "not matched" });
    // A chain with function steps is run whole: the answer lists the function calls and
    // every output (`functions`, `outputs`) instead of each step's.
    if (result.matched && (Array.isArray(result.functions) || Array.isArray(result.outputs))) {
      const failed = this.functionTestRows(result, path, target, rows, marks);
      this.testMarks = marks;
      this.renderCanvas();
      replace(this.testResults, h("ol", { class: "test-steps" }, rows));
      const n = (result.outputs || []).length;
      announce(failed ? "Test: matched, but the chain failed." : `Test: matched; ${n === 0 ? "no event comes out" : n === 1 ? "one event comes out" : `${n} events come out`}.`, failed ? "info" : "ok");
      return;
    }
    const steps = result.steps || [];
    let failed = !result.matched;
    path.forEach((step, i) => {
      const out = steps.find((s) => s.step === i);
      let state = "skip";
      let text = failed ? "Not run." : "No output.";
      if (!failed && out?.error !== undefined) {
        state = "fail";
        text = out.error;
        failed = true;
      } else if (!failed && out) {
        state = "pass";
        text = "Output:";
      }
      rows.push(testRow(`Step ${i + 1}`, step.data.form, state, text, state === "pass" ? out.output : undefined));
      marks.set(step.id, { state, short: state === "pass" ? "✓" : state === "fail" ? "✗" : "–", text });
    });
    if (target) {
      const delivered = !failed;
      const output = path.length ? result.output : event;
      rows.push(testRow("Target", target.data.name, delivered ? "pass" : "skip", delivered ? "Receives:" : "Receives nothing.", delivered ? output : undefined));
      marks.set(target.id, { state: delivered ? "pass" : "skip", short: delivered ? "✓ receives" : "–", text: delivered ? "receives the output" : "receives nothing" });
    }
    this.testMarks = marks;
    this.renderCanvas();
    replace(this.testResults, h("ol", { class: "test-steps" }, rows));
    announce(result.matched ? (failed ? "Test: matched, but a step failed." : "Test: matched.") : "Test: not matched.", result.matched && !failed ? "ok" : "info");
  }

  /**
   * The rows and node marks of a chain run with its functions: each call (the events it
   * returned, or its error), the chain's error, and what the target receives. True if the
   * chain failed.
   */
  functionTestRows(result, path, target, rows, marks) {
    const calls = Array.isArray(result.functions) ? result.functions : [];
    const outputs = Array.isArray(result.outputs) ? result.outputs : result.output !== undefined ? [result.output] : [];
    const error = result.error !== undefined && result.error !== null ? String(result.error) : null;
    const errorStep = error ? Number((error.match(/\bstep (\d+)/) || [])[1]) : NaN;
    // The steps on the canvas: which ran, which failed, which no event reached.
    let reached = true;
    path.forEach((step, i) => {
      let state = "pass";
      let text = "Ran.";
      let short = "✓";
      if (Number.isInteger(errorStep) && i > errorStep) {
        state = "skip";
        text = `Not run: step ${errorStep + 1} failed.`;
      } else if (!reached) {
        state = "skip";
        text = "Not run: a function before it returned no event.";
      } else if (i === errorStep) {
        state = "fail";
        text = error;
      } else if (step.data.form === "WASM") {
        const mine = calls.filter((c) => c.function === step.data.wasm);
        const bad = mine.find((c) => c.error !== undefined);
        const returned = mine.reduce((n, c) => n + (Array.isArray(c.returned) ? c.returned.length : 0), 0);
        if (bad) {
          state = "fail";
          text = bad.error;
        } else if (!mine.length) {
          state = "skip";
          text = "Not called.";
        } else {
          text = `${plural(mine.length, "call")}: returned ${plural(returned, "event")}.`;
          short = `✓ ${plural(returned, "event")}`;
          if (!returned) reached = false;
        }
      }
      marks.set(step.id, { state, short: state === "pass" ? short : state === "fail" ? "✗" : "–", text });
    });
    for (const call of calls) {
      const name = `${call.function}${call.version ? ` · ${shortSha(call.version)}` : ""}`;
      if (call.error !== undefined) {
        rows.push(testRow("Function", name, "fail", `Error${call.outcome ? ` (${call.outcome})` : ""}: ${call.error}`));
        continue;
      }
      const returned = Array.isArray(call.returned) ? call.returned : [];
      const text = returned.length === 0 ? "Returned no event: the event is dropped." : returned.length === 1 ? "Returned 1 event:" : `Returned ${returned.length} events:`;
      rows.push(testRow("Function", name, "pass", text, returned.length === 0 ? undefined : returned.length === 1 ? returned[0] : returned));
    }
    if (error) rows.push(testRow("Chain", "failed", "fail", `${error} — the event would be dead-lettered.`));
    if (target) {
      const delivered = !error && outputs.length > 0;
      let text;
      if (error) text = "Receives nothing: the chain failed, so the event would be dead-lettered.";
      else if (!outputs.length) text = "Receives nothing: a function dropped the event.";
      else if (outputs.length === 1) text = "Receives:";
      else text = `Receives ${outputs.length} events, in this order:`;
      rows.push(testRow("Target", target.data.name, delivered ? "pass" : error ? "fail" : "skip", text, delivered ? (outputs.length === 1 ? outputs[0] : outputs) : undefined));
      marks.set(target.id, {
        state: delivered ? "pass" : "skip",
        short: delivered ? (outputs.length === 1 ? "✓ receives" : `✓ receives ${outputs.length}`) : "–",
        text: delivered ? `receives ${plural(outputs.length, "event")}` : "receives nothing",
      });
    } else if (outputs.length) {
      rows.push(testRow("Outputs", plural(outputs.length, "event"), "pass", "The chain makes:", outputs.length === 1 ? outputs[0] : outputs));
    }
    return Boolean(error);
  }
}

// ---------------------------------------------------------------------------------------
// Picking a rule (the Builder tab without one)

async function renderPicker(root, app) {
  replace(root, notice("loading", "Loading the catalog…"));
  let catalog;
  try {
    catalog = await api.catalog();
  } catch (err) {
    if (!err.isAuth) replace(root, notice("error", "The catalog cannot be loaded", err.detail));
    return null;
  }
  const busSelect = select(
    catalog.buses.map((b) => b.name),
    catalog.buses[0]?.name,
    { class: "input" },
  );
  const ruleList = h("ul", { class: "picker__rules" });
  const fill = () => {
    const rules = catalog.rules.filter((r) => r.bus === busSelect.value);
    replace(
      ruleList,
      rules.length
        ? rules.map((r) => h("li", {}, h("a", { href: `#/builder/${encodeURIComponent(r.bus)}/${encodeURIComponent(r.name)}`, class: "picker__rule" }, clip(r.name), h("span", { class: "muted", text: `${r.targets.length} target${r.targets.length === 1 ? "" : "s"}` }))))
        : h("li", { class: "muted", text: "No rule on this bus yet." }),
    );
  };
  busSelect.addEventListener("change", fill);
  fill();
  replace(
    root,
    h(
      "section",
      { class: "picker", "aria-labelledby": "picker-title" },
      h("h1", { id: "picker-title", class: "view-title", text: "Builder" }),
      catalog.buses.length
        ? [
            h("p", { class: "muted", text: "Open a rule to edit it as a graph, or start a new one." }),
            h("div", { class: "field-row" }, field("Bus", busSelect), button("New rule on this bus", () => app.navigate(`#/builder/${encodeURIComponent(busSelect.value)}/`), { class: "button button--primary" })),
            h("h2", { class: "panel-title", text: "Rules" }),
            ruleList,
          ]
        : notice("empty", "There is no bus yet", "Create a bus in the channels view first.", h("a", { class: "button", href: "#/channels", text: "Channels" })),
    ),
  );
  return null;
}

// ---------------------------------------------------------------------------------------
// Helpers

/** What a node shows: its kind, title and a one-line summary. */
function caption(graph, node) {
  const d = node.data;
  switch (node.kind) {
    case "source":
      if (d.type === "webhook") return { kind: "Webhook source", title: d.name, meta: `${d.preset || "?"} · ${d.path}` };
      if (d.type === "rocketmq") return { kind: "RocketMQ source", title: d.name, meta: d.topic ? `topic ${d.topic}` : "(no topic)" };
      if (d.type && d.type !== "ingress") return { kind: `${d.type} source`, title: d.name, meta: "" };
      return { kind: "Ingress", title: d.bus, meta: `POST /buses/${d.bus}/events` };
    case "filter":
      return {
        kind: "Filter",
        title: d.mode === "all" ? "Every event" : d.mode === "pattern" ? "Pattern" : "CESQL",
        meta: d.mode === "pattern" ? brief((d.pattern || "").replace(/\s+/g, " ")) : d.mode === "filter" ? brief(d.filter) : "matches all",
      };
    case "step": {
      const path = graph.pathTo(node.id);
      const meta = stepSummary(d);
      return { kind: path ? `Step ${path.length + 1}` : "Step (not connected)", title: stepTitle(d.form), meta: d.into === "data" ? `${meta} → data` : meta };
    }
    default:
      return { kind: `Target · ${d.type}`, title: d.name || "(no name)", meta: targetSummary(d) };
  }
}

function stepSummary(d) {
  switch (d.form) {
    case "CONSTANT":
      return brief(d.value);
    case "JSONPATH":
      return String(d.value ?? "");
    case "TEMPLATE":
      return brief(d.template);
    case "SET_ATTRIBUTES":
    case "RENAME_ATTRIBUTES":
      return Object.entries(d.attributes || {})
        .map(([k, v]) => `${k}${d.form === "RENAME_ATTRIBUTES" ? " → " : " = "}${brief(v, 24)}`)
        .join(", ") || "(none yet)";
    case "REMOVE_ATTRIBUTES":
      return (d.attributes || []).join(", ") || "(none yet)";
    case "MAP_DATA":
      return Object.keys(d.fields || {}).join(", ") || "(no fields yet)";
    case "WASM":
      return d.wasm || "(no function yet)";
    default:
      return "unchanged";
  }
}

function targetSummary(d) {
  switch (d.type) {
    case "file":
      return d.path;
    case "http":
    case "function":
      return d.url || "(no URL yet)";
    case "rocketmq":
      return d.topic ? `topic ${d.topic}` : "(no topic yet)";
    case "redis-stream":
      return d.stream ? `stream ${d.stream}` : "(no stream yet)";
    case "bus":
      return d.bus ? `bus ${d.bus}` : "(no bus yet)";
    default:
      return "stdout";
  }
}

/** The source attribute of the events a source stores, as far as the console knows it. */
function sourceAttribute(d) {
  if (d.type === "webhook") return d.path;
  if (d.type === "rocketmq") return d.wrap_source || `rocketmq://${d.topic}`;
  if (d.type && d.type !== "ingress") return "set by the source";
  return "set by the producer";
}

/** A node in a choice list. */
function describe(graph, node) {
  const { kind, title } = caption(graph, node);
  return `${kind}: ${title}`;
}

/** The settings keys a node's side form shows (to tell field errors from node errors). */
function fieldKeys(node) {
  if (node.kind === "filter") return new Set(["pattern", "filter"]);
  if (node.kind === "step") return new Set((STEP_FIELDS[node.data.form] || []).map((s) => s.key));
  if (node.kind === "target") {
    const specs = [...(TARGET_FIELDS[node.data.type] || []), ...(LOCAL_TARGETS.has(node.data.type) ? [] : RETRY_FIELDS)];
    return new Set(["name", "dead_letter.bus", "dead_letter.target", ...specs.map((s) => s.key)]);
  }
  return new Set();
}

/** A function of the catalog in a choice list: its name and short SHA-256. */
function functionOption(f) {
  return `${f.name} · ${shortSha(f.sha256)}${f.loaded?.error ? " · cannot be loaded" : ""}`;
}

function shortSha(sha) {
  return sha ? String(sha).slice(0, 12) : "?";
}

/** Whether this replica runs a function, as GET /api/v1/functions says. */
function loadedText(f) {
  const loaded = f.loaded;
  if (!loaded) return "not loaded on this replica";
  if (loaded.error) return `cannot be loaded: ${loaded.error}`;
  if (!loaded.running) return "loading…";
  if (f.sha256 && loaded.running !== f.sha256) return `running ${shortSha(loaded.running)} (an earlier version; this one is loading)`;
  return "loaded: runs this version";
}

function noFunctionsNotice() {
  return h(
    "div",
    { class: "notice notice--warn", role: "status" },
    h("p", { class: "notice__title" }, "No functions yet: upload one with ", h("code", { text: "PUT /api/v1/functions/{name}" }), " or ", h("code", { text: "sluice ctl apply" })),
  );
}

/** The function step of `path` a message names (`function `f` ...`), if any. */
function functionStep(path, message) {
  const name = String(message || "").match(/function `([^`]+)`/)?.[1];
  return name ? (path || []).find((s) => s.data.form === "WASM" && s.data.wasm === name) || null : null;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function fact(term, value) {
  return [h("dt", { text: term }), h("dd", {}, value)];
}

function testRow(kind, name, state, text, output) {
  return h(
    "li",
    { class: ["test-step", `test-step--${state}`] },
    h("span", { class: "test-step__mark", "aria-hidden": "true", text: state === "pass" ? "✓" : state === "fail" ? "✗" : "–" }),
    h("div", { class: "test-step__body" }, h("p", { class: "test-step__title" }, h("strong", { text: kind }), " ", clip(name), h("span", { class: "visually-hidden", text: ` (${state === "pass" ? "passed" : state === "fail" ? "failed" : "not run"})` })), h("p", { class: "test-step__text", text }), output !== undefined ? h("pre", { class: "code", text: json(output) }) : null),
  );
}

/** A smooth connection between two points (left to right). */
function curve(a, b) {
  const dx = Math.max(40, Math.abs(b.x - a.x) / 2);
  return `M ${a.x} ${a.y} C ${a.x + dx} ${a.y}, ${b.x - dx} ${b.y}, ${b.x} ${b.y}`;
}
