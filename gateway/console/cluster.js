// Cluster: the workers (with the age of their last heartbeat) and the tasks each runs,
// every connector (subscription or source) and its tasks with state, worker, reason, lag
// and delivery rate, and pause / resume / restart. Polled
// every 2 s while the page is visible; updated in place, so focus and open sections stay
// and a task that moves to another worker is highlighted there.

import * as api from "./api.js";
import { announce, button, clip, h, keyed, notice, replace, setText } from "./dom.js";
import { ago, badge, clock, count, heartbeatAge, lag, rate, rateText, updateBadge } from "./format.js";

const POLL_MS = 2000;
/** A heartbeat older than this is shown as late (workers beat every 0.5 s by default). */
const LATE_HEARTBEAT_MS = 2000;

export async function renderCluster(root, _params, app) {
  const view = new ClusterView(root, app);
  view.render();
  await view.poll();
  return view;
}

class ClusterView {
  constructor(root, app) {
    this.root = root;
    this.app = app;
    this.timer = 0;
    this.query = "";
    this.first = true;
    this.onVisibility = () => {
      if (document.visibilityState === "visible") this.poll();
      else this.setLive("paused");
    };
    document.addEventListener("visibilitychange", this.onVisibility);
  }

  destroy() {
    this.stopped = true;
    clearTimeout(this.timer);
    document.removeEventListener("visibilitychange", this.onVisibility);
  }

  render() {
    this.summaryEl = h("p", { class: "view-summary muted" });
    // Not a live region: it changes every 2 s, which a screen reader would read every time.
    this.liveEl = h("p", { class: "live" }, h("span", { class: "live__dot", "aria-hidden": "true" }), h("span", { class: "live__text", text: "Connecting…" }));
    this.errorEl = h("div", {});
    this.workersEl = h("div", { class: "workers" });
    this.connectorsEl = h("div", { class: "connectors" });
    const search = h("input", {
      type: "search",
      class: "input",
      placeholder: "Filter connectors",
      on: {
        input: () => {
          this.query = search.value.trim().toLowerCase();
          this.renderConnectors();
        },
      },
    });
    search.id = "connector-filter";
    replace(
      this.root,
      h(
        "section",
        { class: "cluster", "aria-labelledby": "cluster-title" },
        h("header", { class: "view-header" }, h("h1", { id: "cluster-title", class: "view-title", text: "Cluster" }), this.summaryEl, h("div", { class: "view-actions" }, this.liveEl, button("Refresh now", () => this.poll(), { class: "button" }))),
        this.errorEl,
        h("h2", { class: "section-title", text: "Workers and their tasks" }),
        this.workersEl,
        h("div", { class: "section-header" }, h("h2", { class: "section-title", id: "connectors-title", text: "Connectors" }), h("div", { class: "field field--inline" }, h("label", { for: "connector-filter", class: "field__label", text: "Filter" }), search)),
        this.connectorsEl,
      ),
    );
    this.workersEl.append(notice("loading", "Loading the cluster…"));
  }

  async poll() {
    clearTimeout(this.timer);
    if (this.stopped) return;
    // One request at a time: a poll asked for meanwhile runs right after this one.
    if (this.inFlight) {
      this.again = true;
      return;
    }
    this.inFlight = true;
    try {
      await this.pollOnce();
    } finally {
      this.inFlight = false;
    }
    if (this.again) {
      this.again = false;
      this.poll();
    }
  }

  async pollOnce() {
    if (document.visibilityState !== "visible") {
      this.setLive("paused");
      return;
    }
    try {
      const [cluster, connectors] = await Promise.all([api.cluster(), api.connectors()]);
      if (this.stopped) return;
      this.cluster = cluster;
      this.connectors = connectors.items;
      this.errorEl.replaceChildren();
      this.update();
      this.setLive("live");
    } catch (err) {
      if (this.stopped) return;
      if (err.isAuth) {
        this.setLive("error");
        return;
      }
      replace(this.errorEl, notice("error", this.cluster ? "The last update failed: showing the one before" : "The cluster cannot be read", err.detail));
      if (!this.cluster) this.workersEl.replaceChildren();
      this.setLive("error");
    }
    this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  setLive(state) {
    this.liveEl.dataset.state = state;
    const text = { live: `Live · updated ${clock()}`, paused: "Paused while the page is hidden", error: "Not updating" }[state];
    setText(this.liveEl.querySelector(".live__text"), text);
  }

  update() {
    const c = this.cluster;
    const running = Object.values(c.assignment || {}).reduce((n, tasks) => n + tasks.length, 0);
    const totalLag = this.connectors.reduce((n, x) => n + (x.lag || 0), 0);
    const rates = this.connectors.filter((x) => x.kind === "subscription" && typeof x?.rate === "number");
    const delivered = rates.length ? ` · delivering ${rateText(rates.reduce((n, x) => n + x.rate, 0))}` : "";
    setText(this.summaryEl, `Answered by ${c.worker} · ${c.strategy} · ${c.members.length} worker${c.members.length === 1 ? "" : "s"} · ${running} running task${running === 1 ? "" : "s"} · ${count(totalLag)} events behind${delivered}`);
    this.renderWorkers();
    this.renderConnectors();
    this.first = false;
  }

  renderWorkers() {
    const c = this.cluster;
    const byId = new Map((c.statuses || []).map((s) => [s.id, s]));
    // `workers` (age of each worker's last heartbeat) is newer than the rest of the answer.
    const beats = new Map((c?.workers || []).map((w) => [w?.id, w?.heartbeat_age_ms]));
    const workers = [...new Set([...c.members, ...Object.keys(c.assignment || {})])].sort();
    const cards = workers.map((w) => ({ key: `worker:${w}`, worker: w, tasks: (c.assignment?.[w] || []).map((id) => byId.get(id) || { id, state: "RUNNING", worker: w }) }));
    // Tasks of the running configuration that are not running (statuses of removed buses and
    // rules linger in the cluster store: not shown).
    const known = new Set(this.connectors.flatMap((x) => x.tasks.map((t) => t.id)));
    const buses = new Set(this.connectors.filter((x) => x.kind === "subscription").map((x) => x.id.split("/")[0]));
    const idle = (c.statuses || []).filter((s) => s.id.includes("#") && s.state !== "RUNNING" && (known.has(s.id) || buses.has(s.id.slice(4, s.id.lastIndexOf("#")))));
    if (idle.length) cards.push({ key: "idle", worker: null, tasks: idle });
    if (!cards.length) {
      replace(this.workersEl, notice("empty", "No worker has joined yet"));
      return;
    }
    keyed(
      this.workersEl,
      cards,
      (card) => card.key,
      (card) => {
        const title = h("h3", { class: "card__title" });
        return h("section", { class: "card worker" }, h("header", { class: "card__header" }, title, h("span", { class: "worker__count muted" })), h("p", { class: "worker__heartbeat", hidden: true }), h("ul", { class: "worker__tasks" }));
      },
      (el, card) => {
        const title = el.querySelector(".card__title");
        if (!title.childElementCount) {
          if (card.worker) {
            title.append(h("span", { class: "card__kind", text: "Worker" }), clip(card.worker));
            if (card.worker === c.worker) title.append(h("span", { class: "chip", text: "answered" }));
          } else {
            title.append(h("span", { class: "card__kind", text: "Tasks" }), clip("not running"));
          }
          el.setAttribute("aria-label", card.worker ? `Worker ${card.worker}` : "Tasks not running");
        }
        el.classList.toggle("worker--gone", Boolean(card.worker) && !c.members.includes(card.worker));
        setText(el.querySelector(".worker__count"), `${card.tasks.length} task${card.tasks.length === 1 ? "" : "s"}${card.worker && !c.members.includes(card.worker) ? " · left the cluster" : ""}`);
        const beat = el.querySelector(".worker__heartbeat");
        const age = card.worker ? beats.get(card.worker) : undefined;
        beat.hidden = typeof age !== "number";
        if (typeof age === "number") {
          const late = age > LATE_HEARTBEAT_MS;
          beat.classList.toggle("is-late", late);
          setText(beat, `heartbeat ${heartbeatAge(age)}${late ? " · late" : ""}`);
          beat.title = late ? `No heartbeat for ${count(age)} ms: the worker may be stopped or starved; its tasks move once it is gone (cluster.member_ttl).` : `Last heartbeat ${count(age)} ms ago`;
        }
        const list = el.querySelector(".worker__tasks");
        if (!card.tasks.length) {
          if (!list.querySelector(".worker__none")) replace(list, h("li", { class: "worker__none muted", text: "No task" }));
          return;
        }
        list.querySelector(".worker__none")?.remove();
        keyed(
          list,
          card.tasks,
          (t) => t.id,
          (t) => {
            const li = h("li", { class: ["task", !this.first && "is-new"] }, clip(t.id, { class: "task__id" }), badge(t.state));
            li.addEventListener("animationend", () => li.classList.remove("is-new"), { once: true });
            return li;
          },
          (li, t) => {
            updateBadge(li.querySelector(".badge"), t.state);
            li.title = [t.id, t.reason, t.changed_at ? `since ${ago(t.changed_at)}` : ""].filter(Boolean).join(" · ");
          },
        );
      },
    );
  }

  renderConnectors() {
    if (!this.connectors) return;
    const q = this.query;
    const items = this.connectors.filter((x) => !q || x.id.toLowerCase().includes(q) || (x.worker || "").toLowerCase().includes(q));
    if (!this.connectors.length) {
      replace(this.connectorsEl, notice("empty", "No connector runs", "Each target of a rule is a connector (a subscription); so is each source."));
      return;
    }
    if (!items.length) {
      replace(this.connectorsEl, notice("empty", "No connector matches the filter"));
      return;
    }
    this.connectorsEl.querySelector(".notice")?.remove();
    keyed(
      this.connectorsEl,
      items,
      (x) => x.id,
      (x) => this.createConnector(x),
      (el, x) => this.updateConnector(el, x),
    );
  }

  createConnector(x) {
    const actions = h(
      "div",
      { class: "connector__actions" },
      ["pause", "resume", "restart"].map((action) => button(cap(action), () => this.act(x.id, action), { class: ["button", "button--small", action === "restart" && "button--warn"], "aria-label": `${cap(action)} ${x.id}` })),
    );
    const tasks = h(
      "table",
      { class: "table tasks" },
      h("caption", { class: "visually-hidden", text: `Tasks of ${x.id}` }),
      h("thead", {}, h("tr", {}, [x.kind === "source" ? "Task" : "Shard", "State", "Worker", "Position", "End", "Lag", "Rate", "Reason", "Actions"].map((t) => h("th", { scope: "col", text: t })))),
      h("tbody", {}),
    );
    return h(
      "article",
      { class: "card connector", "aria-label": `Connector ${x.id}` },
      h(
        "div",
        { class: "connector__head" },
        h("div", { class: "connector__id" }, h("span", { class: "card__kind", text: x.kind === "source" ? "Source" : "Subscription" }), clip(x.id, { class: "connector__name" })),
        h("span", { class: "connector__state" }, badge(x.state)),
        h("span", { class: "connector__worker" }),
        h("span", { class: "connector__lag" }),
        h("span", { class: "connector__rate" }),
        actions,
      ),
      h("p", { class: "connector__reason" }),
      h("details", { class: "connector__tasks" }, h("summary", {}), h("div", { class: "table-wrap" }, tasks)),
    );
  }

  updateConnector(el, x) {
    updateBadge(el.querySelector(".connector__state .badge"), x.state);
    const worker = el.querySelector(".connector__worker");
    replace(worker, x.worker ? [h("span", { class: "muted", text: "worker " }), clip(x.worker)] : h("span", { class: "muted", text: "—" }));
    replace(el.querySelector(".connector__lag"), h("span", { class: "muted", text: "lag " }), lag(x.lag));
    // Sources have no delivery rate (the place stays, so the columns line up); subscriptions
    // have one once the gateway measures it.
    const rateEl = el.querySelector(".connector__rate");
    rateEl.classList.toggle("is-empty", x.kind === "source" && (x?.rate === undefined || x?.rate === null));
    replace(rateEl, h("span", { class: "muted", text: "rate " }), rate(x?.rate));
    const reason = el.querySelector(".connector__reason");
    setText(reason, x.reason || "");
    reason.hidden = !x.reason;
    reason.classList.toggle("is-error", x.state === "FAILED");
    const states = x.tasks.reduce((m, t) => ((m[t.state] = (m[t.state] || 0) + 1), m), {});
    setText(el.querySelector("summary"), `${x.tasks.length} task${x.tasks.length === 1 ? "" : "s"}: ${Object.entries(states).map(([s, n]) => `${n} ${s.toLowerCase()}`).join(", ") || "none"}`);
    keyed(
      el.querySelector("tbody"),
      x.tasks,
      (t) => t.id,
      (t) => {
        const index = t.shard ?? t.index;
        return h(
          "tr",
          {},
          h("th", { scope: "row", text: String(index) }),
          h("td", {}, badge(t.state)),
          h("td", { class: "task__worker" }),
          h("td", { class: "num task__position" }),
          h("td", { class: "num task__end" }),
          h("td", { class: "num task__lag" }),
          h("td", { class: "num task__rate" }),
          h("td", { class: "task__reason" }),
          h(
            "td",
            { class: "task__actions" },
            ["pause", "resume", "restart"].map((action) => button(cap(action), () => this.act(x.id, action, index), { class: "button button--small", "aria-label": `${cap(action)} task ${index} of ${x.id}` })),
          ),
        );
      },
      (tr, t) => {
        updateBadge(tr.querySelector(".badge"), t.state);
        const cell = tr.querySelector(".task__worker");
        if (cell.textContent !== (t.worker || "—")) {
          const moved = cell.textContent && cell.textContent !== "—" && t.worker;
          replace(cell, clip(t.worker || "—"));
          if (moved) {
            tr.classList.add("is-new");
            tr.addEventListener("animationend", () => tr.classList.remove("is-new"), { once: true });
          }
        }
        setText(tr.querySelector(".task__position"), t.position === undefined ? "—" : count(t.position));
        setText(tr.querySelector(".task__end"), t.end === undefined ? "—" : count(t.end));
        replace(tr.querySelector(".task__lag"), lag(t.lag));
        replace(tr.querySelector(".task__rate"), x.kind === "source" ? "—" : rate(t?.rate));
        replace(tr.querySelector(".task__reason"), t.reason ? clip(t.reason) : "");
      },
    );
  }

  async act(id, action, task) {
    const what = task === undefined ? id : `task ${task} of ${id}`;
    try {
      await api.connectorAction(id, action, task);
      announce(`${cap(action)} of ${what} requested.`, "ok");
    } catch (err) {
      if (!err.isAuth) announce(`${cap(action)} of ${what} refused: ${err.detail}`, "error");
    }
    this.poll();
  }
}

function cap(text) {
  return text.charAt(0).toUpperCase() + text.slice(1);
}
