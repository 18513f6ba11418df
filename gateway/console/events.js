// Events: the recent events of a bus with their delivery state per subscription, dead
// letters with their reason and a redeliver action, and replays of a time range into one
// rule (start, follow, cancel).

import * as api from "./api.js";
import { announce, append, button, clip, confirmDialog, dialog, field, h, keyed, notice, replace, select, setText } from "./dom.js";
import { ago, badge, count, fromLocalInput, json, time, toLocalInput, updateBadge } from "./format.js";

const LIMITS = [20, 50, 100, 200];
const REPLAY_POLL_MS = 2000;

export async function renderEvents(root, { bus }, app) {
  let catalog;
  replace(root, notice("loading", "Loading…"));
  try {
    catalog = await api.catalog();
  } catch (err) {
    if (!err.isAuth) replace(root, notice("error", "The catalog cannot be loaded", err.detail));
    return null;
  }
  if (!catalog.buses.length) {
    replace(root, notice("empty", "There is no bus yet", "Create one in the channels view.", h("a", { class: "button", href: "#/channels", text: "Channels" })));
    return null;
  }
  if (!bus || !catalog.buses.some((b) => b.name === bus)) {
    if (bus) announce(`There is no bus ${bus}: showing ${catalog.buses[0].name}.`, "error");
    bus = catalog.buses[0].name;
    app.replaceRoute(`#/events/${encodeURIComponent(bus)}`);
  }
  const view = new EventsView(root, app, catalog, bus);
  view.render();
  view.loadEvents();
  view.loadReplays();
  return view;
}

/** Whether an event is a dead letter (it carries the dead-letter extensions). */
export function isDeadLetter(event) {
  return Boolean(event && (event.deadletterreason !== undefined || event.deadletterrule !== undefined));
}

class EventsView {
  constructor(root, app, catalog, bus) {
    this.root = root;
    this.app = app;
    this.catalog = catalog;
    this.bus = bus;
    this.limit = 20;
    this.deadOnly = false;
    this.replayTimer = 0;
    this.onVisibility = () => document.visibilityState === "visible" && this.replaysRunning && this.loadReplays();
    document.addEventListener("visibilitychange", this.onVisibility);
  }

  destroy() {
    this.stopped = true;
    clearTimeout(this.replayTimer);
    document.removeEventListener("visibilitychange", this.onVisibility);
  }

  get busResource() {
    return this.catalog.buses.find((b) => b.name === this.bus);
  }

  get rules() {
    return this.catalog.rules.filter((r) => r.bus === this.bus);
  }

  /** Rules whose targets send their dead letters to this bus. */
  get feeders() {
    return this.catalog.rules.filter((r) => r.targets.some((t) => t.dead_letter?.bus === this.bus));
  }

  render() {
    const busSelect = select(
      this.catalog.buses.map((b) => b.name),
      this.bus,
      { class: "input", on: { change: () => this.app.navigate(`#/events/${encodeURIComponent(busSelect.value)}`) } },
    );
    const limitSelect = select(
      LIMITS.map((n) => [n, `${n} newest`]),
      this.limit,
      {
        class: "input",
        on: {
          change: () => {
            this.limit = Number(limitSelect.value);
            this.loadEvents();
          },
        },
      },
    );
    const deadOnly = h("input", {
      type: "checkbox",
      checked: this.deadOnly,
      on: {
        change: () => {
          this.deadOnly = deadOnly.checked;
          this.renderEvents();
        },
      },
    });
    this.eventsEl = h("div", { class: "events" }, notice("loading", "Loading the recent events…"));
    this.eventsSummary = h("p", { class: "muted", role: "status" });
    this.replaysEl = h("div", { class: "replays" });
    const feeders = this.feeders;
    replace(
      this.root,
      h(
        "section",
        { class: "events-view", "aria-labelledby": "events-title" },
        h(
          "header",
          { class: "view-header" },
          h("h1", { id: "events-title", class: "view-title", text: "Events" }),
          h("div", { class: "view-actions" }, field("Bus", busSelect), field("Show", limitSelect), field("Dead letters only", deadOnly), button("Refresh", () => this.loadEvents(), { class: "button" })),
        ),
        feeders.length
          ? h(
              "p",
              { class: "callout" },
              "This bus takes the dead letters of ",
              feeders.map((r, i) => [i ? ", " : "", h("a", { href: `#/builder/${encodeURIComponent(r.bus)}/${encodeURIComponent(r.name)}`, text: `${r.bus}/${r.name}` })]),
              ". Redeliver one once its cause is fixed.",
            )
          : null,
        h("section", { class: "panel", "aria-labelledby": "recent-title" }, h("div", { class: "section-header" }, h("h2", { class: "section-title", id: "recent-title", text: "Recent events" }), this.eventsSummary), this.eventsEl),
        this.renderReplayPanel(),
      ),
    );
  }

  // -------------------------------------------------------------------------------------
  // Recent events

  async loadEvents() {
    try {
      const { items } = await api.recentEvents(this.bus, this.limit);
      if (this.stopped) return;
      this.events = items;
      this.eventsError = null;
    } catch (err) {
      if (err.isAuth || this.stopped) return;
      this.events = null;
      this.eventsError = err;
    }
    this.renderEvents();
  }

  renderEvents() {
    if (this.eventsError) {
      replace(this.eventsEl, notice("error", "The recent events cannot be read", this.eventsError.status === 404 && !this.eventsError.problem.detail ? "This gateway does not serve GET /api/v1/buses/{bus}/events." : this.eventsError.detail, button("Try again", () => this.loadEvents(), { class: "button" })));
      setText(this.eventsSummary, "");
      return;
    }
    const all = this.events || [];
    const dead = all.filter((i) => isDeadLetter(i.event));
    const items = this.deadOnly ? dead : all;
    setText(this.eventsSummary, `${count(all.length)} event${all.length === 1 ? "" : "s"}${dead.length ? `, ${count(dead.length)} dead letter${dead.length === 1 ? "" : "s"}` : ""} · newest first`);
    if (!items.length) {
      replace(
        this.eventsEl,
        notice(
          "empty",
          this.deadOnly ? "No dead letter among the recent events" : "No event on this bus yet",
          this.deadOnly ? "Dead letters carry the deadletterreason extension." : `Producers post to /buses/${this.bus}/events. Events delivered to every subscription may be gone unless the bus has a retention.`,
        ),
      );
      return;
    }
    if (!this.eventsEl.querySelector(".events__head")) {
      replace(
        this.eventsEl,
        h("div", { class: "events__head", "aria-hidden": "true" }, ["Accepted", "Type", "ID", "Source", "Deliveries"].map((t) => h("span", { text: t }))),
        h("ul", { class: "events__list" }),
      );
    }
    keyed(
      this.eventsEl.querySelector(".events__list"),
      items,
      (i) => `${i.shard}:${i.seq}`,
      (i) => this.createEvent(i),
      (el, i) => this.updateEvent(el, i),
    );
  }

  createEvent(item) {
    const e = item.event || {};
    const dead = isDeadLetter(e);
    const summary = h(
      "summary",
      { class: "event__summary" },
      h("span", { class: "event__time" }, h("span", { class: "visually-hidden", text: "Accepted " }), time(item.accepted_ms)),
      h("span", { class: "event__type" }, dead ? h("span", { class: "badge badge--error", text: "dead letter" }) : null, clip(e.type)),
      h("span", { class: "event__id" }, h("span", { class: "visually-hidden", text: "id " }), clip(e.id)),
      h("span", { class: "event__source" }, h("span", { class: "visually-hidden", text: "source " }), clip(e.source)),
      h("span", { class: "event__deliveries" }),
    );
    const body = h("div", { class: "event__body" });
    if (dead) body.append(this.deadLetterInfo(item));
    append(body, [
      h("dl", { class: "facts facts--inline" }, fact("Shard", item.shard), fact("Position", count(item.seq)), fact("Accepted", `${time(item.accepted_ms)} (${ago(item.accepted_ms)})`), e.subject ? fact("Subject", clip(e.subject)) : null),
      h("div", { class: "event__subs" }),
      h("details", { class: "event__json" }, h("summary", { text: "The event as JSON" }), h("pre", { class: "code", text: json(e) })),
    ]);
    return h("li", {}, h("details", { class: ["event", dead && "event--dead"] }, summary, body));
  }

  updateEvent(li, item) {
    const subs = Object.entries(item.subscriptions || {});
    const pending = subs.filter(([, s]) => s !== "delivered").length;
    const cell = li.querySelector(".event__deliveries");
    replace(cell, subs.length ? [badge(pending ? "pending" : "delivered"), h("span", { class: "muted", text: ` ${subs.length - pending}/${subs.length}` })] : h("span", { class: "muted", text: "no subscription" }));
    cell.title = subs.map(([name, s]) => `${name}: ${s}`).join("\n");
    const list = li.querySelector(".event__subs");
    replace(
      list,
      subs.length
        ? h(
            "ul",
            { class: "sub-states", "aria-label": "Delivery per subscription" },
            subs.map(([name, state]) => h("li", {}, clip(name), badge(state))),
          )
        : h("p", { class: "muted", text: "No rule of this bus takes this event." }),
    );
  }

  deadLetterInfo(item) {
    const e = item.event;
    return h(
      "div",
      { class: "dead-letter" },
      h("p", { class: "dead-letter__reason" }, h("strong", { text: "Why: " }), e.deadletterreason || "(no reason given)"),
      h(
        "dl",
        { class: "facts facts--inline" },
        fact("Rule", clip(e.deadletterrule ?? "—")),
        e.deadlettertarget !== undefined ? fact("Target", clip(e.deadlettertarget)) : null,
        fact("Status", String(e.deadletterstatus ?? "—")),
        fact("Attempts", String(e.deadletterattempts ?? "—")),
      ),
      button("Redeliver…", () => this.redeliver(item), { class: "button button--primary", "aria-label": `Redeliver dead letter ${e.id}` }),
    );
  }

  /** The original bus of a dead letter: a bus with a rule of that name (the one sending here first). */
  originalBus(ruleName) {
    const named = this.catalog.rules.filter((r) => r.name === ruleName);
    const feeding = named.find((r) => r.targets.some((t) => t.dead_letter?.bus === this.bus));
    return (feeding || named[0])?.bus || this.catalog.buses[0]?.name;
  }

  async redeliver(item) {
    const e = item.event;
    const controls = {};
    const result = await dialog({
      title: "Redeliver a dead letter",
      submitLabel: "Redeliver",
      build: (body) => {
        controls.bus = select(
          this.catalog.buses.map((b) => b.name),
          connectorPart(e, 0) ?? this.originalBus(e.deadletterrule),
          { class: "input" },
        );
        controls.rule = h("select", { class: "input" });
        controls.target = h("select", { class: "input" });
        const fillRules = () => {
          const rules = this.catalog.rules.filter((r) => r.bus === controls.bus.value);
          const named = connectorPart(e, 1) ?? e.deadletterrule;
          const wanted = rules.some((r) => r.name === named) ? named : rules[0]?.name;
          replace(controls.rule, rules.length ? rules.map((r) => h("option", { value: r.name, text: r.name, selected: r.name === wanted })) : h("option", { value: "", text: "No rule on this bus" }));
          fillTargets();
        };
        const fillTargets = () => {
          const rule = this.catalog.rules.find((r) => r.bus === controls.bus.value && r.name === controls.rule.value);
          const targets = rule?.targets || [];
          const wanted = connectorPart(e, 2) || failedTarget(targets, e.deadlettertarget)?.name || "";
          replace(controls.target, h("option", { value: "", text: "All its targets", selected: !wanted }), targets.map((t) => h("option", { value: t.name, text: `${t.name} (${t.type})`, selected: t.name === wanted })));
        };
        controls.bus.addEventListener("change", fillRules);
        controls.rule.addEventListener("change", fillTargets);
        fillRules();
        append(body, [
          h("p", {}, "Event ", h("code", { text: e.id }), " failed: ", e.deadletterreason || "(no reason given)"),
          h(
            "div",
            { class: "form-grid" },
            field("Original bus", controls.bus, { hint: "The bus of the rule that failed to deliver it." }),
            field("Rule", controls.rule),
            field("Target", controls.target, { hint: "Only that target, or every target of the rule." }),
          ),
          h("p", { class: "muted", text: "The event goes to the rule's targets only (transform, retry and dead letters apply), marked with the sluicereplay extension; its deadletter* extensions are dropped." }),
        ]);
        return () => {
          if (!controls.rule.value) throw new Error("Choose a bus that has the rule.");
          return { bus: controls.bus.value, rule: controls.rule.value, target: controls.target.value || undefined };
        };
      },
      submit: async (choice) => {
        try {
          const body = { event: e };
          if (choice.target) body.target = choice.target;
          choice.answer = await api.redeliver(choice.bus, choice.rule, body);
        } catch (err) {
          throw new Error(err.isAuth ? "Sign in first." : err.detail);
        }
      },
    });
    if (result) {
      const targets = result.answer?.targets?.join(", ") || result.target || "its targets";
      announce(`Redelivery ${result.answer?.id || ""} of ${e.id} accepted for ${result.bus}/${result.rule}: ${targets}.`, "ok");
    }
  }

  // -------------------------------------------------------------------------------------
  // Replays

  renderReplayPanel() {
    const rules = this.rules;
    const ruleSelect = select(rules.length ? rules.map((r) => r.name) : [["", "No rule on this bus"]], rules[0]?.name, { class: "input" });
    const targetSelect = h("select", { class: "input" });
    const fillTargets = () => {
      const rule = rules.find((r) => r.name === ruleSelect.value);
      replace(targetSelect, h("option", { value: "", text: "All its targets" }), (rule?.targets || []).map((t) => h("option", { value: t.name, text: `${t.name} (${t.type})` })));
    };
    ruleSelect.addEventListener("change", fillTargets);
    fillTargets();
    const now = Date.now();
    const from = h("input", { type: "datetime-local", class: "input", value: toLocalInput(now - 3600 * 1000) });
    const to = h("input", { type: "datetime-local", class: "input", value: "" });
    const error = h("p", { class: "form-error", role: "alert", hidden: true });
    const form = h(
      "form",
      {
        class: "replay-form",
        novalidate: true,
        on: {
          submit: async (ev) => {
            ev.preventDefault();
            error.hidden = true;
            const body = { rule: ruleSelect.value };
            if (targetSelect.value) body.target = targetSelect.value;
            const fromMs = fromLocalInput(from.value);
            const toMs = fromLocalInput(to.value);
            if (fromMs !== null) body.from = fromMs;
            if (toMs !== null) body.to = toMs;
            if (!body.rule) {
              error.textContent = "This bus has no rule to replay into.";
              error.hidden = false;
              return;
            }
            if (fromMs !== null && toMs !== null && toMs <= fromMs) {
              error.textContent = "The end must be after the start.";
              error.hidden = false;
              to.focus();
              return;
            }
            const submit = form.querySelector("button[type=submit]");
            submit.disabled = true;
            try {
              const status = await api.startReplay(this.bus, body);
              announce(`Replay ${status.id} started: ${body.rule}${body.target ? `/${body.target}` : ""}.`, "ok");
              this.loadReplays();
            } catch (err) {
              if (!err.isAuth) {
                error.textContent = err.detail;
                error.hidden = false;
              }
            } finally {
              submit.disabled = false;
            }
          },
        },
      },
      h(
        "div",
        { class: "form-grid" },
        field("Into rule", ruleSelect),
        field("Target", targetSelect),
        field("From (local time)", from, { hint: "Acceptance time, inclusive. Empty: the oldest kept event." }),
        field("To (local time)", to, { hint: "Exclusive. Empty: the end of each shard now." }),
      ),
      error,
      h("div", { class: "form-actions" }, h("button", { type: "submit", class: "button button--primary", text: "Start replay" })),
    );
    const bus = this.busResource;
    return h(
      "section",
      { class: "panel", "aria-labelledby": "replays-title" },
      h("div", { class: "section-header" }, h("h2", { class: "section-title", id: "replays-title", text: "Replays" }), button("Refresh", () => this.loadReplays(), { class: "button button--small" })),
      bus && !bus.retention ? notice("warn", "This bus keeps no retention", "Events are dropped once every subscription has passed them, so a replay finds only those still in the log. Give the bus a retention to keep them.") : null,
      h("details", { class: "replay-new", open: true }, h("summary", { text: "Replay a time range into one rule" }), form),
      this.replaysEl,
    );
  }

  async loadReplays() {
    clearTimeout(this.replayTimer);
    try {
      const { items } = await api.replays(this.bus);
      if (this.stopped) return;
      this.renderReplays(items);
      this.replaysRunning = items.some((r) => r.state === "RUNNING");
    } catch (err) {
      if (err.isAuth || this.stopped) return;
      replace(this.replaysEl, notice("error", "The replays cannot be read", err.detail));
      this.replaysRunning = false;
    }
    if (this.replaysRunning && document.visibilityState === "visible") this.replayTimer = setTimeout(() => this.loadReplays(), REPLAY_POLL_MS);
  }

  renderReplays(items) {
    if (!items.length) {
      replace(this.replaysEl, notice("empty", "No replay of this bus yet"));
      return;
    }
    if (!this.replaysEl.querySelector("table")) {
      replace(
        this.replaysEl,
        h(
          "div",
          { class: "table-wrap" },
          h(
            "table",
            { class: "table replays__table" },
            h("caption", { class: "visually-hidden", text: `Replays of bus ${this.bus}, newest first` }),
            h("thead", {}, h("tr", {}, ["Replay", "Into", "State", "Range (accepted)", "Read", "Matched", "Delivered", "Worker", "Started", ""].map((t) => h("th", { scope: "col", text: t })))),
            h("tbody", {}),
          ),
        ),
      );
    }
    keyed(
      this.replaysEl.querySelector("tbody"),
      items,
      (r) => r.id,
      (r) =>
        h(
          "tr",
          {},
          h("th", { scope: "row" }, clip(r.id)),
          h("td", {}, clip(`${r.rule} → ${r.targets.join(", ")}`)),
          h("td", { class: "replay__state" }, badge(r.state), h("span", { class: "replay__reason" })),
          h("td", { class: "replay__range" }),
          h("td", { class: "num replay__read" }),
          h("td", { class: "num replay__matched" }),
          h("td", { class: "num replay__delivered" }),
          h("td", {}, clip(r.worker)),
          h("td", { text: time(r.created_ms) }),
          h("td", { class: "replay__actions" }),
        ),
      (tr, r) => {
        updateBadge(tr.querySelector(".badge"), r.state);
        const reason = tr.querySelector(".replay__reason");
        replace(reason, r.reason ? clip(r.reason, { class: "muted" }) : "");
        const range = tr.querySelector(".replay__range");
        setText(range, `${r.from_ms ? time(r.from_ms) : "oldest kept"} → ${r.to_ms ? time(r.to_ms) : "end"}`);
        range.title = Object.entries(r.shards || {})
          .map(([shard, s]) => `shard ${shard}: positions ${s.from} to ${s.to}, next ${s.next}`)
          .join("\n");
        setText(tr.querySelector(".replay__read"), count(r.read));
        setText(tr.querySelector(".replay__matched"), count(r.matched));
        setText(tr.querySelector(".replay__delivered"), count(r.delivered));
        const actions = tr.querySelector(".replay__actions");
        if (r.state === "RUNNING" && !actions.firstChild) actions.append(button("Cancel", () => this.cancelReplay(r), { class: "button button--small button--danger", "aria-label": `Cancel replay ${r.id}` }));
        if (r.state !== "RUNNING") actions.replaceChildren();
      },
    );
  }

  async cancelReplay(replay) {
    if (!(await confirmDialog(`Cancel replay ${replay.id}?`, "Events it has not re-delivered yet will not be.", { confirmLabel: "Cancel replay" }))) return;
    try {
      await api.cancelReplay(this.bus, replay.id);
      announce(`Replay ${replay.id} cancelled.`, "ok");
    } catch (err) {
      if (!err.isAuth) announce(`Replay ${replay.id} not cancelled: ${err.detail}`, "error");
    }
    this.loadReplays();
  }
}

/**
 * A part of the connector a dead letter failed at (`deadletterconnector` is
 * `bus/rule/target`): 0 the bus, 1 the rule, 2 the target; `undefined` without it.
 */
export function connectorPart(e, index) {
  const parts = typeof e?.deadletterconnector === "string" ? e.deadletterconnector.split("/") : [];
  return parts.length === 3 ? parts[index] : undefined;
}

/**
 * The target a dead letter failed at: `deadlettertarget` names it, or describes it as the
 * gateway's logs do (`http <url>`, `file <path>`...).
 */
export function failedTarget(targets, described) {
  if (!described) return null;
  return (
    targets.find((t) => t.name === described) ||
    targets.find((t) => {
      const [type, ...rest] = String(described).split(" ");
      const where = rest.join(" ");
      return t.type === type && where && [t.url, t.path, t.topic, t.stream, t.bus].some((v) => v && (v === where || where.includes(v)));
    }) ||
    null
  );
}

function fact(term, value) {
  return [h("dt", { text: term }), h("dd", {}, value)];
}
