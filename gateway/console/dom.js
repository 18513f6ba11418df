// Small DOM helpers: building elements without innerHTML (every text from the API is set
// as text, never parsed as markup), keyed lists that update in place (so polling never
// steals focus or closes what the user opened), dialogs and the status announcer.

let ids = 0;

/** A unique id for labels and aria references. */
export function uid(prefix = "id") {
  ids += 1;
  return `${prefix}-${ids}`;
}

/**
 * Creates an element. `props`: `class`, `text`, `dataset`, `style` (an object, applied
 * through the CSSOM so the CSP allows it), `on` ({event: handler}), boolean properties
 * (`disabled`, `checked`, `hidden`...), `value`, and any other attribute (set as text).
 */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  applyProps(el, props);
  append(el, children);
  return el;
}

const PROPERTIES = new Set(["value", "checked", "disabled", "hidden", "selected", "open", "readOnly", "required", "multiple", "indeterminate"]);

function applyProps(el, props) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false && !PROPERTIES.has(key)) continue;
    if (key === "class") el.className = Array.isArray(value) ? value.filter(Boolean).join(" ") : value;
    else if (key === "text") el.textContent = String(value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "style") Object.assign(el.style, value);
    else if (key === "on") for (const [event, handler] of Object.entries(value)) el.addEventListener(event, handler);
    else if (PROPERTIES.has(key)) el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
}

/** Appends children: nodes, text, arrays of them; null and false are skipped. */
export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replaces every child of `el`. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/**
 * An SVG element. The namespace is the one of the logo, an inline `<svg>` of the page (HTML
 * gives it the SVG namespace by itself), so no URL is spelled in the code.
 */
export function svg(tag, attrs = {}) {
  const el = document.createElementNS(document.querySelector("svg").namespaceURI, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  return el;
}

/** Text that may be too long: ellipsized by CSS, the whole of it in the tooltip. */
export function clip(text, props = {}) {
  const value = text === undefined || text === null ? "" : String(text);
  return h("span", { ...props, class: ["clip", props.class], title: value, text: value });
}

/** A button. */
export function button(label, onClick, props = {}) {
  return h("button", { type: "button", ...props, on: { click: onClick, ...(props.on || {}) } }, label);
}

/**
 * Keeps the children of `container` in step with `items`: an element per key, created once
 * by `create(item)` and refreshed by `update(el, item)`, in the items' order. Elements of
 * keys that are gone are removed. Focus and open `<details>` survive every refresh.
 */
export function keyed(container, items, key, create, update) {
  const existing = new Map();
  for (const child of [...container.children]) {
    if (child.dataset.key !== undefined) existing.set(child.dataset.key, child);
    else child.remove();
  }
  let cursor = container.firstElementChild;
  for (const item of items) {
    const k = String(key(item));
    let el = existing.get(k);
    if (el) existing.delete(k);
    else {
      el = create(item);
      el.dataset.key = k;
    }
    update(el, item);
    if (el !== cursor) container.insertBefore(el, cursor);
    else cursor = cursor.nextElementSibling;
  }
  for (const el of existing.values()) el.remove();
}

/** Sets text only when it changed (no needless DOM churn for screen readers). */
export function setText(el, text) {
  const value = text === undefined || text === null ? "" : String(text);
  if (el.textContent !== value) el.textContent = value;
  if (el.classList.contains("clip") && el.title !== value) el.title = value;
}

// ---------------------------------------------------------------------------------------
// Status messages

let statusTimer = 0;

/** Announces a message in the status bar (an aria-live region). `kind`: info, ok, error. */
export function announce(message, kind = "info") {
  const el = document.getElementById("status");
  if (!el) return;
  clearTimeout(statusTimer);
  el.dataset.kind = kind;
  // Clearing first makes screen readers read the same message again.
  el.textContent = "";
  requestAnimationFrame(() => {
    el.textContent = message;
  });
  statusTimer = setTimeout(
    () => {
      if (el.textContent === message) el.textContent = "";
    },
    kind === "error" ? 20000 : 8000,
  );
}

/** Clears the status bar (the user moved on). */
export function clearStatus() {
  const el = document.getElementById("status");
  if (el) el.textContent = "";
}

// ---------------------------------------------------------------------------------------
// Dialogs

/**
 * A modal dialog with a form. `build(form)` fills it and may return a function that gives
 * the dialog's value (or throws an Error whose message is shown). Resolves to the value,
 * or null when cancelled. `submit` may be async and return false to keep the dialog open.
 */
export function dialog({ title, build, submitLabel = "Save", danger = false, submit }) {
  return new Promise((resolve) => {
    const titleId = uid("dialog-title");
    const error = h("p", { class: "form-error", role: "alert", hidden: true });
    const form = h("form", { method: "dialog", class: "dialog__form", novalidate: true });
    const body = h("div", { class: "dialog__body" });
    const cancel = button("Cancel", () => close(null), { class: "button" });
    const ok = h("button", { type: "submit", class: ["button", danger ? "button--danger" : "button--primary"] }, submitLabel);
    const el = h(
      "dialog",
      { class: "dialog", "aria-labelledby": titleId },
      h("h2", { id: titleId, class: "dialog__title", text: title }),
      form,
    );
    append(form, [body, error, h("div", { class: "dialog__actions" }, cancel, ok)]);
    const read = build(body) || (() => true);
    let done = false;
    function close(value) {
      if (done) return;
      done = true;
      el.close();
      el.remove();
      resolve(value);
    }
    el.addEventListener("cancel", (e) => {
      e.preventDefault();
      close(null);
    });
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      error.hidden = true;
      let value;
      try {
        value = read();
      } catch (err) {
        error.textContent = err.message;
        error.hidden = false;
        return;
      }
      if (submit) {
        ok.disabled = true;
        try {
          const kept = await submit(value);
          if (kept === false) return;
        } catch (err) {
          error.textContent = err.message;
          error.hidden = false;
          return;
        } finally {
          ok.disabled = false;
        }
      }
      close(value);
    });
    document.body.append(el);
    el.showModal();
    const first = body.querySelector("input:not([disabled]), select, textarea");
    (first || ok).focus();
  });
}

/** A yes/no question. Resolves to true when confirmed. */
export async function confirmDialog(title, message, { confirmLabel = "Delete", danger = true } = {}) {
  const value = await dialog({
    title,
    submitLabel: confirmLabel,
    danger,
    build: (body) => {
      append(body, [h("p", { text: message })]);
      return () => true;
    },
  });
  return value === true;
}

/** A labelled form field. `control` is an input, select or textarea (given an id here). */
export function field(label, control, { hint, error, wide } = {}) {
  control.id ||= uid("field");
  const hintEl = hint ? h("span", { class: "field__hint", id: uid("hint"), text: hint }) : null;
  // Not an alert: errors follow typing; the control is aria-invalid and described by it.
  const errorEl = h("span", { class: "field__error", id: uid("error"), hidden: !error, text: error || "" });
  const described = [hintEl?.id, errorEl.id].filter(Boolean).join(" ");
  control.setAttribute("aria-describedby", described);
  if (error) control.setAttribute("aria-invalid", "true");
  const isCheck = control.type === "checkbox" || control.type === "radio";
  const labelEl = h("label", { for: control.id, class: "field__label", text: label });
  return h(
    "div",
    { class: ["field", isCheck && "field--check", wide && "field--wide"] },
    isCheck ? [control, labelEl] : [labelEl, control],
    hintEl,
    errorEl,
  );
}

/** Shows (or clears) the error of a field made by `field`. */
export function setFieldError(fieldEl, message) {
  const errorEl = fieldEl.querySelector(".field__error");
  const control = fieldEl.querySelector("input, select, textarea");
  errorEl.textContent = message || "";
  errorEl.hidden = !message;
  if (message) control?.setAttribute("aria-invalid", "true");
  else control?.removeAttribute("aria-invalid");
}

/** A `<select>` with options `[value, label]` (or plain values). */
export function select(options, value, props = {}) {
  const el = h("select", props);
  for (const option of options) {
    const [v, label] = Array.isArray(option) ? option : [option, option];
    el.append(h("option", { value: v, text: label, selected: String(v) === String(value ?? "") }));
  }
  return el;
}

/** A region saying what is happening: loading, empty, or an error (with its detail). */
export function notice(kind, title, detail, ...actions) {
  return h(
    "div",
    { class: ["notice", `notice--${kind}`], role: kind === "error" ? "alert" : "status" },
    h("p", { class: "notice__title", text: title }),
    detail ? h("p", { class: "notice__detail", text: detail }) : null,
    actions.length ? h("div", { class: "notice__actions" }, actions) : null,
  );
}

export function loading(what = "Loading…") {
  return notice("loading", what);
}
