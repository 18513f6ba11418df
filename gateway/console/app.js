// The Sluice console: a single page over the admin API (/api/v1). This module routes
// (#/channels, #/builder/{bus}/{rule}, #/cluster, #/events/{bus}), asks for the admin token
// when the API answers 401 or 403, and owns the status bar.

import * as api from "./api.js";
import { announce, button, clearStatus, notice } from "./dom.js";
import { renderBuilder } from "./builder.js";
import { renderChannels } from "./channels.js";
import { renderCluster } from "./cluster.js";
import { renderEvents } from "./events.js";

const ROUTES = {
  channels: { title: "Channels", render: renderChannels },
  builder: { title: "Builder", render: renderBuilder },
  cluster: { title: "Cluster", render: renderCluster },
  events: { title: "Events", render: renderEvents },
};

const main = document.getElementById("main");
let current = null;
let currentHash = null;
let generation = 0;

/** `#/builder/orders/to-billing` → {name: "builder", params: {bus, rule}}. */
function parse(hash) {
  const parts = hash
    .replace(/^#\/?/, "")
    .split("/")
    .map((p) => {
      try {
        return decodeURIComponent(p);
      } catch {
        return p;
      }
    });
  const name = ROUTES[parts[0]] ? parts[0] : "channels";
  return { name, params: { bus: parts[1] || "", rule: parts[2] || "" } };
}

const app = {
  navigate(hash) {
    if (location.hash === hash) show();
    else location.hash = hash;
  },
  /** Changes the address without showing the view again (a rule just created, say). */
  replaceRoute(hash) {
    history.replaceState(null, "", hash);
    currentHash = location.hash;
  },
  rerender() {
    show({ force: true });
  },
};

async function show({ force = false } = {}) {
  const hash = location.hash || "#/channels";
  if (!force && hash === currentHash) return;
  const warning = current?.leaveWarning?.();
  if (warning && !force && !window.confirm(warning)) {
    // Stay: put the address back without showing anything again.
    history.replaceState(null, "", currentHash);
    return;
  }
  current?.destroy?.();
  current = null;
  clearStatus();
  const firstShow = currentHash === null;
  currentHash = hash;
  const { name, params } = parse(hash);
  for (const link of document.querySelectorAll("[data-route]")) {
    if (link.dataset.route === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `${ROUTES[name].title}${params.bus ? ` · ${params.bus}` : ""} · Sluice console`;
  // Each view draws into its own container: a slow view that finishes after the user
  // moved on draws into a container no longer on the page.
  const container = document.createElement("div");
  container.className = `view view--${name}`;
  main.replaceChildren(container);
  if (!firstShow) main.focus({ preventScroll: false });
  const mine = ++generation;
  try {
    const view = await ROUTES[name].render(container, params, app);
    if (mine !== generation) view?.destroy?.();
    else current = view;
  } catch (err) {
    console.error(err);
    announce(`This view failed: ${err.message}`, "error");
  }
}

// ---------------------------------------------------------------------------------------
// Credentials

const signIn = document.getElementById("sign-in");
const signInForm = document.getElementById("sign-in-form");
const tokenInput = document.getElementById("sign-in-token");
const signInMessage = document.getElementById("sign-in-message");
const signOut = document.getElementById("sign-out");

function showSignIn(error) {
  const hadToken = Boolean(api.token());
  signInMessage.textContent =
    error.status === 403 && error.problem.field === "admin.tokens"
      ? `${error.detail}. A token does not help here: open the console on the gateway's own machine (loopback), or configure admin.tokens.`
      : hadToken
        ? `The token was refused: ${error.detail}`
        : `The admin API needs a token: ${error.detail}`;
  openSignIn();
  // What was still loading cannot load without credentials: say so where it would be.
  for (const pending of main.querySelectorAll(".notice--loading")) {
    pending.replaceWith(notice("error", "The admin API needs credentials", signInMessage.textContent, button("Sign in", openSignIn, { class: "button button--primary" })));
  }
  announce("Sign in to use the admin API.", "error");
}

function openSignIn() {
  if (signIn.open) return;
  tokenInput.value = "";
  signIn.showModal();
  tokenInput.focus();
}

signInForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const value = tokenInput.value.trim();
  if (!value) {
    signInMessage.textContent = "Enter the admin token.";
    tokenInput.focus();
    return;
  }
  api.setToken(value);
  signIn.close();
  updateSignOut();
  app.rerender();
});

document.getElementById("sign-in-cancel").addEventListener("click", () => signIn.close());

signOut.addEventListener("click", () => {
  api.setToken("");
  updateSignOut();
  announce("Signed out: the token is forgotten.");
  app.rerender();
});

function updateSignOut() {
  signOut.hidden = !api.token();
}

api.onAuthNeeded(showSignIn);

// ---------------------------------------------------------------------------------------
// Start

document.querySelector(".skip-link").addEventListener("click", (e) => {
  e.preventDefault();
  main.focus();
});

window.addEventListener("hashchange", () => show());
window.addEventListener("beforeunload", (e) => {
  if (current?.leaveWarning?.()) {
    e.preventDefault();
    e.returnValue = "";
  }
});

updateSignOut();
if (!location.hash) history.replaceState(null, "", "#/channels");
show();
