// Formatting: times, counts, JSON, and the state badges every view shares.

import { h } from "./dom.js";

const numberFormat = new Intl.NumberFormat();
const timeFormat = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "medium" });
const clockFormat = new Intl.DateTimeFormat(undefined, { timeStyle: "medium" });

export function count(n) {
  return n === null || n === undefined ? "—" : numberFormat.format(n);
}

/** A byte count in binary units: 1536 -> "1.5 KiB". */
export function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n) || 0;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(value < 10 ? 1 : 0)} ${units[unit]}`;
}

/** Milliseconds since the epoch as a local date and time. */
export function time(ms) {
  if (ms === null || ms === undefined || ms === "") return "—";
  const date = new Date(typeof ms === "number" ? ms : Date.parse(ms));
  return Number.isNaN(date.getTime()) ? String(ms) : timeFormat.format(date);
}

export function clock(date = new Date()) {
  return clockFormat.format(date);
}

/** "3 s ago", "5 min ago"... for a time in ms since the epoch. */
export function ago(ms) {
  if (!ms) return "";
  const seconds = Math.round((Date.now() - ms) / 1000);
  if (seconds < 5) return "just now";
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

/** A duration as the API writes it (`86400000ms`) in the largest whole unit (`24h`). */
export function duration(value) {
  if (value === undefined || value === null) return "";
  const m = /^(\d+)ms$/.exec(String(value));
  if (!m) return String(value);
  const ms = Number(m[1]);
  for (const [unit, size] of [
    ["h", 3600000],
    ["m", 60000],
    ["s", 1000],
  ]) {
    if (ms >= size && ms % size === 0) return `${ms / size}${unit}`;
  }
  return `${ms}ms`;
}

export function json(value) {
  return JSON.stringify(value, null, 2);
}

/** A one-line summary of a JSON value, for tooltips and node captions. */
export function brief(value, max = 80) {
  const text = typeof value === "string" ? value : JSON.stringify(value);
  if (text === undefined) return "";
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

const STATE_KIND = {
  RUNNING: "ok",
  COMPLETED: "ok",
  delivered: "ok",
  PAUSED: "warn",
  pending: "warn",
  UNASSIGNED: "muted",
  CANCELLED: "muted",
  FAILED: "error",
};

/** A state (RUNNING, PAUSED, FAILED, UNASSIGNED, delivered, pending...) as a badge. */
export function badge(state, props = {}) {
  return h("span", { ...props, class: ["badge", `badge--${STATE_KIND[state] || "muted"}`, props.class], text: state || "—" });
}

export function updateBadge(el, state) {
  const kind = STATE_KIND[state] || "muted";
  el.className = `badge badge--${kind}`;
  if (el.textContent !== state) el.textContent = state || "—";
}

/** A lag (events behind) with a hint of how bad it is. */
export function lag(n) {
  const value = n === null || n === undefined ? "—" : count(n);
  const kind = !n ? "lag lag--none" : n < 1000 ? "lag lag--some" : "lag lag--high";
  return h("span", { class: kind, title: n === null || n === undefined ? "not known yet" : `${value} events behind`, text: value });
}

/** Events per second as text: "—" while unknown, then "0/s", "0.08/s", "12.5/s", "1,234/s". */
export function rateText(n) {
  if (n === null || n === undefined || Number.isNaN(Number(n))) return "—";
  const v = Number(n);
  if (v === 0) return "0/s";
  if (v < 10) return `${Number(v.toPrecision(2))}/s`;
  if (v < 100) return `${Math.round(v * 10) / 10}/s`;
  return `${numberFormat.format(Math.round(v))}/s`;
}

/** A delivery rate (events/s over the last minute, summed over the cluster). */
export function rate(n) {
  const unknown = n === null || n === undefined;
  return h("span", {
    class: ["rate", unknown ? "rate--unknown" : Number(n) > 0 ? "rate--flowing" : "rate--idle"],
    title: unknown ? "Throughput not known yet: it is measured every 5 s, once asked" : `${rateText(n)}: events delivered per second over the last minute, whole cluster`,
    text: rateText(n),
  });
}

/** How long ago a heartbeat was, from its age in ms: "0.4 s ago", "12 s ago", "3 min ago". */
export function heartbeatAge(ms) {
  if (ms === null || ms === undefined) return "";
  if (ms < 10000) return `${(Math.max(0, ms) / 1000).toFixed(1)} s ago`;
  if (ms < 120000) return `${Math.round(ms / 1000)} s ago`;
  return `${Math.round(ms / 60000)} min ago`;
}

/** `datetime-local` input text for a time in ms, and back (local time). */
export function toLocalInput(ms) {
  const date = new Date(ms);
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}T${pad(date.getHours())}:${pad(date.getMinutes())}`;
}

export function fromLocalInput(text) {
  if (!text) return null;
  const ms = new Date(text).getTime();
  return Number.isNaN(ms) ? null : ms;
}
