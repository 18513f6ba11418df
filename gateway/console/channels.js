// Channels: the buses of the catalog and the rules on each, with the state, lag and
// throughput (delivered events/s) of every rule's targets (their connectors). Buses are
// created, edited and deleted here; rules are opened in the builder.

import * as api from "./api.js";
import { announce, button, clip, confirmDialog, dialog, field, h, notice, replace, setFieldError } from "./dom.js";
import { badge, brief, bytes, count, duration, lag, rate, updateBadge } from "./format.js";
import { NAME_PATTERN } from "./graph.js";
import { parseValue } from "./fields.js";

const REFRESH_MS = 5000;

export async function renderChannels(root, _params, app) {
  const view = new ChannelsView(root, app);
  await view.load();
  return view;
}

class ChannelsView {
  constructor(root, app) {
    this.root = root;
    this.app = app;
    this.timer = 0;
    this.query = "";
  }

  destroy() {
    clearTimeout(this.timer);
    this.stopped = true;
  }

  async load() {
    if (!this.catalog) replace(this.root, notice("loading", "Loading the channels…"));
    try {
      const [catalog, connectors] = await Promise.all([api.catalog(), api.connectors().catch((e) => (e.isAuth ? Promise.reject(e) : { items: [], error: e }))]);
      this.catalog = catalog;
      this.connectors = new Map(connectors.items.map((c) => [c.id, c]));
      this.connectorsError = connectors.error;
    } catch (err) {
      if (!err.isAuth) replace(this.root, notice("error", "The catalog cannot be loaded", err.detail, button("Try again", () => this.load(), { class: "button" })));
      return;
    }
    this.render();
    this.schedule();
  }

  schedule() {
    clearTimeout(this.timer);
    if (this.stopped) return;
    this.timer = setTimeout(() => this.refreshStates(), REFRESH_MS);
  }

  /** Connector states, lags and rates, updated in place. */
  async refreshStates() {
    if (document.visibilityState === "visible") {
      try {
        const { items } = await api.connectors();
        this.connectors = new Map(items.map((c) => [c.id, c]));
        for (const el of this.root.querySelectorAll("[data-connector]")) {
          const c = this.connectors.get(el.dataset.connector);
          const state = el.querySelector(".badge");
          if (state) updateBadge(state, c?.state || "UNASSIGNED");
          const lagEl = el.querySelector(".lag");
          if (lagEl) lagEl.replaceWith(lag(c?.lag));
          const rateEl = el.querySelector(".rate");
          if (rateEl) rateEl.replaceWith(rate(c?.rate));
        }
      } catch {
        // The next refresh tries again; the page says nothing about a missed one.
      }
    }
    this.schedule();
  }

  render() {
    const { buses, rules, sources } = this.catalog;
    const search = h("input", {
      type: "search",
      class: "input",
      placeholder: "Filter by bus, rule or target name",
      value: this.query,
      on: {
        input: () => {
          this.query = search.value;
          this.renderBuses();
        },
      },
    });
    this.busesEl = h("div", { class: "bus-list" });
    replace(
      this.root,
      h(
        "section",
        { class: "channels", "aria-labelledby": "channels-title" },
        h(
          "header",
          { class: "view-header" },
          h("h1", { id: "channels-title", class: "view-title", text: "Channels", tabindex: "-1" }),
          h("p", { class: "view-summary muted", text: `${buses.length} bus${buses.length === 1 ? "" : "es"} · ${rules.length} rule${rules.length === 1 ? "" : "s"} · catalog version ${this.catalog.version}` }),
          h("div", { class: "view-actions" }, field("Filter", search), button("Refresh", () => this.load(), { class: "button" }), button("New bus", () => this.editBus(null), { class: "button button--primary" })),
        ),
        this.connectorsError ? notice("warn", "Delivery states are not available", this.connectorsError.detail) : null,
        this.busesEl,
        sources.length ? this.renderSources(sources) : null,
      ),
    );
    this.renderBuses();
    // After an action whose button is gone with the redraw, focus goes to the title.
    if (this.refocus) {
      this.refocus = false;
      this.root.querySelector(".view-title")?.focus();
    }
  }

  renderBuses() {
    const { buses, rules } = this.catalog;
    if (!buses.length) {
      replace(this.busesEl, notice("empty", "There is no bus yet", "A bus takes events at POST /buses/{bus}/events; rules on it send them to targets.", button("New bus", () => this.editBus(null), { class: "button button--primary" })));
      return;
    }
    const q = this.query.trim().toLowerCase();
    const matches = (bus, rule) => !q || bus.name.toLowerCase().includes(q) || (rule && (rule.name.toLowerCase().includes(q) || rule.targets.some((t) => t.name.toLowerCase().includes(q))));
    const shown = buses.filter((b) => matches(b) || rules.some((r) => r.bus === b.name && matches(b, r)));
    if (!shown.length) {
      replace(this.busesEl, notice("empty", "Nothing matches the filter", `No bus, rule or target name contains "${this.query}".`));
      return;
    }
    replace(
      this.busesEl,
      shown.map((bus) => this.renderBus(bus, rules.filter((r) => r.bus === bus.name && (matches(bus) || matches(bus, r))))),
    );
  }

  renderBus(bus, rules) {
    const titleId = `bus-${bus.name}`;
    const enc = encodeURIComponent(bus.name);
    const chips = [
      `${bus.shards} shard${bus.shards === 1 ? "" : "s"}`,
      bus.retention ? `retention ${duration(bus.retention)}` : null,
      bus.retention_bytes ? `retention ${bytes(bus.retention_bytes)}` : null,
      bus.max_backlog_age ? `backlog ≤ ${duration(bus.max_backlog_age)}` : null,
      bus.dedup_window ? `dedup ${duration(bus.dedup_window)}` : null,
      bus.auth ? "API keys" : null,
      bus.rate_limit ? `${bus.rate_limit.per_second}/s` : null,
    ].filter(Boolean);
    return h(
      "section",
      { class: "card bus", "aria-labelledby": titleId },
      h(
        "header",
        { class: "card__header" },
        h("h2", { id: titleId, class: "card__title" }, h("span", { class: "card__kind", text: "Bus" }), clip(bus.name)),
        h("ul", { class: "chips", "aria-label": "Settings" }, chips.map((c) => h("li", { class: "chip", text: c }))),
        h(
          "div",
          { class: "card__actions" },
          h("a", { class: "button button--primary", href: `#/builder/${enc}/`, text: "New rule", "aria-label": `New rule on bus ${bus.name}` }),
          h("a", { class: "button", href: `#/events/${enc}`, text: "Events", "aria-label": `Events of bus ${bus.name}` }),
          button("Edit", () => this.editBus(bus), { class: "button", "aria-label": `Edit bus ${bus.name}` }),
          button("Delete", () => this.deleteBus(bus), { class: "button button--danger", "aria-label": `Delete bus ${bus.name}` }),
        ),
      ),
      rules.length
        ? h(
            "div",
            { class: "table-wrap" },
            h(
              "table",
              { class: "table rules" },
              h("caption", { class: "visually-hidden", text: `Rules of bus ${bus.name}` }),
              h("thead", {}, h("tr", {}, ["Rule", "Takes", "Targets: state, lag and throughput", "Actions"].map((t) => h("th", { scope: "col", text: t })))),
              h("tbody", {}, rules.map((rule) => this.renderRule(bus, rule))),
            ),
          )
        : h("p", { class: "card__empty muted" }, "No rule on this bus yet: ", h("a", { href: `#/builder/${enc}/`, text: "create one in the builder" }), "."),
    );
  }

  renderRule(bus, rule) {
    const href = `#/builder/${encodeURIComponent(bus.name)}/${encodeURIComponent(rule.name)}`;
    const condition = rule.filter !== undefined ? `CESQL: ${rule.filter}` : rule.pattern && Object.keys(rule.pattern).length ? `pattern ${JSON.stringify(rule.pattern)}` : "every event";
    return h(
      "tr",
      {},
      h("th", { scope: "row", class: "rules__name" }, h("a", { href, title: `Open ${rule.name} in the builder` }, clip(rule.name))),
      h("td", { class: "rules__condition" }, clip(brief(condition, 200), { class: "code-inline" })),
      h(
        "td",
        {},
        h(
          "ul",
          { class: "target-states" },
          rule.targets.map((t) => {
            const id = `${bus.name}/${rule.name}/${t.name}`;
            const c = this.connectors.get(id);
            return h(
              "li",
              { dataset: { connector: id } },
              clip(t.name, { class: "target-states__name" }),
              h("span", { class: "muted target-states__type", text: t.type }),
              badge(c?.state || "UNASSIGNED", { title: c?.reason || "" }),
              lag(c?.lag),
              rate(c?.rate),
            );
          }),
        ),
      ),
      h(
        "td",
        { class: "rules__actions" },
        h("a", { class: "button button--small", href, text: "Open", "aria-label": `Open rule ${rule.name} in the builder` }),
        button("Delete", () => this.deleteRule(rule), { class: "button button--small button--danger", "aria-label": `Delete rule ${rule.name}` }),
      ),
    );
  }

  renderSources(sources) {
    return h(
      "section",
      { class: "card", "aria-labelledby": "sources-title" },
      h("header", { class: "card__header" }, h("h2", { id: "sources-title", class: "card__title", text: "Source connectors" })),
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          { class: "table" },
          h("thead", {}, h("tr", {}, ["Source", "Type", "Into bus", "State", "Lag"].map((t) => h("th", { scope: "col", text: t })))),
          h(
            "tbody",
            {},
            sources.map((s) => {
              const c = this.connectors.get(`source/${s.name}`);
              return h("tr", { dataset: { connector: `source/${s.name}` } }, h("th", { scope: "row" }, clip(s.name)), h("td", { text: s.type }), h("td", {}, clip(s.bus)), h("td", {}, badge(c?.state || "UNASSIGNED", { title: c?.reason || "" })), h("td", {}, lag(c?.lag)));
            }),
          ),
        ),
      ),
    );
  }

  // -------------------------------------------------------------------------------------
  // Buses

  async editBus(bus) {
    const isNew = !bus;
    const controls = {};
    const fields = {};
    const input = (key, value, props = {}) => {
      controls[key] = h("input", { class: "input", value: value ?? "", autocomplete: "off", spellcheck: "false", dataset: { field: key }, ...props });
      return controls[key];
    };
    const saved = await dialog({
      title: isNew ? "New bus" : `Edit bus ${bus.name}`,
      submitLabel: isNew ? "Create bus" : "Save bus",
      build: (body) => {
        fields.name = field("Name", input("name", bus?.name, { disabled: !isNew, required: true }), { hint: "Letters, digits, -, _ and . (not first)." });
        fields.shards = field("Shards", input("shards", bus?.shards ?? 4, { inputmode: "numeric" }), { hint: isNew ? "Order is kept per shard; 1 to 1024." : "Cannot change once the bus holds events." });
        fields.retention = field("Retention", input("retention", duration(bus?.retention), { placeholder: "e.g. 168h" }), { hint: "Keep events this long after acceptance, for replays. Empty: none." });
        fields.retention_bytes = field("Retention (bytes)", input("retention_bytes", bus?.retention_bytes, { inputmode: "numeric", placeholder: "e.g. 1073741824" }), { hint: "Keep at most this many bytes of passed events across the bus (the newest). Empty: no size bound." });
        fields.max_backlog_age = field("Max backlog age", input("max_backlog_age", duration(bus?.max_backlog_age), { placeholder: "168h" }), { hint: "A subscription that has not delivered an event this old (paused, failing, behind) skips it, counted and logged. Empty: a week." });
        fields.dedup_window = field("Deduplication window", input("dedup_window", duration(bus?.dedup_window), { placeholder: "e.g. 24h" }), { hint: "Drop a CloudEvent whose source + id was stored within it. Empty: off." });
        fields["rate_limit.per_second"] = field("Rate limit (requests/s)", input("rate_limit.per_second", bus?.rate_limit?.per_second, { inputmode: "decimal" }), { hint: "Empty: no limit." });
        fields["rate_limit.burst"] = field("Burst", input("rate_limit.burst", bus?.rate_limit?.burst, { inputmode: "numeric" }), { hint: "Default: one second's worth." });
        controls["auth.keys"] = h("textarea", { class: "input input--code", rows: 3, spellcheck: "false", value: (bus?.auth?.keys || []).join("\n"), dataset: { field: "auth.keys" } });
        fields["auth.keys"] = field("Producer API keys", controls["auth.keys"], { hint: "One per line: env:VAR, sha256:<hex>, or a key in clear (kept as its digest). Empty: no key needed.", wide: true });
        body.append(h("div", { class: "form-grid" }, Object.values(fields)));
        return () => {
          for (const f of Object.values(fields)) setFieldError(f, null);
          const name = controls.name.value.trim();
          if (!NAME_PATTERN.test(name)) {
            setFieldError(fields.name, "Letters, digits, -, _ and . (not first), at most 128.");
            throw new Error("The name is not valid.");
          }
          const read = (key, kind) => {
            try {
              return parseValue({ kind }, controls[key].value);
            } catch (e) {
              setFieldError(fields[key], e.message);
              throw new Error(`${key}: ${e.message}`);
            }
          };
          const body = { ...api.withoutVersion(bus || {}), name };
          const set = (key, value) => (value === undefined ? delete body[key] : (body[key] = value));
          set("shards", read("shards", "integer"));
          set("retention", read("retention", "duration"));
          set("retention_bytes", read("retention_bytes", "integer"));
          set("max_backlog_age", read("max_backlog_age", "duration"));
          set("dedup_window", read("dedup_window", "duration"));
          const perSecond = read("rate_limit.per_second", "number");
          const burst = read("rate_limit.burst", "integer");
          set("rate_limit", perSecond === undefined ? undefined : burst === undefined ? { per_second: perSecond } : { per_second: perSecond, burst });
          const keys = read("auth.keys", "lines");
          set("auth", keys ? { keys } : undefined);
          return body;
        };
      },
      submit: async (body) => {
        try {
          await api.putBus(body.name, body, isNew ? null : bus.version);
        } catch (err) {
          if (err.isAuth) throw new Error("Sign in first.");
          const key = (err.pointer || "").split("/").filter(Boolean).join(".");
          const at = fields[key] || fields[key.split(".")[0]];
          if (at) setFieldError(at, err.detail);
          if (err.status === 412) throw new Error(isNew ? `A bus named ${body.name} exists already.` : "Someone else changed this bus meanwhile: close this form and edit it again.");
          throw new Error(err.detail);
        }
      },
    });
    if (saved) {
      announce(`${isNew ? "Created" : "Saved"} bus ${saved.name}.`, "ok");
      this.refocus = true;
      await this.load();
    }
  }

  async deleteBus(bus) {
    if (!(await confirmDialog(`Delete bus ${bus.name}?`, "Producers posting to it will get 404. A bus that rules or sources use cannot be deleted: delete them first."))) return;
    try {
      await api.deleteBus(bus.name, bus.version);
      announce(`Deleted bus ${bus.name}.`, "ok");
      this.refocus = true;
      await this.load();
    } catch (err) {
      if (!err.isAuth) {
        announce(`Bus ${bus.name} not deleted: ${err.status === 412 ? "it changed meanwhile; refresh and try again" : err.detail}`, "error");
      }
    }
  }

  async deleteRule(rule) {
    if (!(await confirmDialog(`Delete rule ${rule.name}?`, `Its ${count(rule.targets.length)} target${rule.targets.length === 1 ? "" : "s"} stop receiving events of bus ${rule.bus}; their positions are dropped.`))) return;
    try {
      await api.deleteRule(rule.bus, rule.name, rule.version);
      announce(`Deleted rule ${rule.name}.`, "ok");
      this.refocus = true;
      await this.load();
    } catch (err) {
      if (!err.isAuth) announce(`Rule ${rule.name} not deleted: ${err.status === 412 ? "it changed meanwhile; refresh and try again" : err.detail}`, "error");
    }
  }
}
