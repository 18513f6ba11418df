// The web console in a real browser: playwright-core driving the system's Chromium against
// two gateways of one cluster (distributed mode). `make console-check` starts them and runs
// this; by hand:
//
//   node tests/console/smoke.mjs URL1 URL2 PID2 [screenshot dir]
//
// URL1 and URL2 are the two replicas (the console is used on URL1; URL2 is only asked for its
// worker id and given an event), PID2 the second one's process id: the test kills it
// (SIGKILL) and watches its tasks move to the first. The replicas must run with
// `[cluster] member_ttl` and `lease_ttl` of a few seconds (the Makefile uses 3 s) and a
// webhook source on bus `default` (the Makefile's `console-hook`, preset `none`).
//
// playwright-core is loaded from the current directory's node_modules (or PLAYWRIGHT_CORE),
// Chromium from CHROMIUM (default /usr/bin/chromium). The gateway must answer the admin
// API without a token (loopback with admin.allow_local_without_token = true, as the Makefile
// sets), or set SLUICE_ADMIN_TOKEN here too.
// CONSOLE_DIR=gateway/console serves the console's files from that directory instead of the
// binary's copy (with the same headers), to try changes without rebuilding.
//
// What it does: creates a bus in the console and builds a channel on it by drag and drop
// (bus → filter → transform step → file target; also a log target by keyboard, an invalid
// target shown at its node), edits a RocketMQ source of the bus in the builder, tests the
// channel on a sample event, saves it, posts events and sees them delivered and counted
// (events view, channels and cluster views with state, lag and throughput), pauses and
// resumes a connector, kills the second replica and sees its worker go and every task run on
// the first within 20 s, adds a function step (WASM) to the channel, shows the webhook source
// of bus `default`, and checks a narrow screen.
//
// The function step: with a component (CONSOLE_FUNCTION, default
// target/functions/country-lookup.wasm, which `make functions` builds) it is uploaded as a
// function of the catalog, chosen in the step's form, saved as exactly `{"wasm": name}`,
// loaded back as that step, and tested (a call returning one event, and one failing).
// Without one, the step is added, must show "choose a function", and is sent to the dry
// run as `{"wasm": ""}`; then the rule is reloaded as saved.
//
// A screenshot of every page goes to the screenshot directory (console-*.png).
// Any browser console error, page error, CSP violation, failed request or unexpected HTTP
// error answer fails it; it deletes what it created.

import { createRequire } from "node:module";
import { readFile } from "node:fs/promises";
import { mkdirSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const base = (process.argv[2] || "http://127.0.0.1:18080").replace(/\/$/, "");
const base2 = (process.argv[3] || "").replace(/\/$/, "");
const pid2 = Number(process.argv[4] || 0);
const shots = process.argv[5] || "target/console-screenshots";
mkdirSync(shots, { recursive: true });
const require = createRequire(path.join(process.env.PLAYWRIGHT_CORE || process.cwd(), "noop.js"));
const { chromium } = require("playwright-core");

const started = Date.now();
const stamp = Date.now().toString(36);
const bus = `console-smoke-${stamp}`;
const rule = "smoke-rule";
const mqSource = `console-smoke-${stamp}-mq`;
const fn = `console-smoke-${stamp}-fn`;
const functionComponent = process.env.CONSOLE_FUNCTION || fileURLToPath(new URL("../../target/functions/country-lookup.wasm", import.meta.url));
const token = process.env.SLUICE_ADMIN_TOKEN || "";
const problems = [];
let step = "start";

/** HTTP error answers the console asks for on purpose: a draft that does not validate yet. */
const EXPECTED_ERRORS = [
  { status: 400, method: "POST", path: /\/api\/v1\/catalog\/apply\?dry_run=true$/ },
  { status: 400, method: "POST", path: /\/api\/v1\/rules\/test$/ },
  { status: 400, method: "PUT", path: /\/api\/v1\/sources\/[^/]+$/ },
];

function check(condition, message) {
  if (!condition) throw new Error(message);
}

function seconds(ms) {
  return `${(ms / 1000).toFixed(1)} s`;
}

async function shot(page, name) {
  // From the top, so the sticky header is where it belongs in a full-page picture.
  await page.evaluate(() => window.scrollTo(0, 0));
  await page.screenshot({ path: `${shots}/console-${name}.png`, fullPage: true });
}

/** Serves the console from `dir` with the headers the gateway gives it (CSP included). */
async function serveFromDisk(context, dir) {
  const served = await context.request.get(`${base}/console/`);
  const headers = served.headers();
  const types = { html: "text/html; charset=utf-8", js: "text/javascript; charset=utf-8", css: "text/css; charset=utf-8", svg: "image/svg+xml" };
  await context.route(`${base}/console/**`, async (route) => {
    const name = new URL(route.request().url()).pathname.replace(/^\/console\/?/, "") || "index.html";
    try {
      const body = await readFile(path.join(dir, path.basename(name)));
      await route.fulfill({ status: 200, body, headers: { ...headers, "content-type": types[name.split(".").pop()] || "application/octet-stream" } });
    } catch {
      await route.fallback();
    }
  });
}

async function main() {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium", args: ["--no-sandbox"] });
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  if (process.env.CONSOLE_DIR) await serveFromDisk(context, process.env.CONSOLE_DIR);
  // CSP violations are reported as console errors too; this names them for sure.
  await context.addInitScript(() => {
    document.addEventListener("securitypolicyviolation", (e) => console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI || "inline"}`));
  });
  const page = await context.newPage();
  page.on("console", (m) => {
    // The browser logs every error answer as "Failed to load resource"; the response
    // handler below tells expected ones (a dry run refusing a draft) from the others.
    if (m.type() === "error" && !/^Failed to load resource: the server responded with a status of \d+/.test(m.text())) problems.push(`console: ${m.text()}`);
  });
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  page.on("requestfailed", (r) => {
    // The builder cancels a dry run that a newer edit made stale: not a failure.
    if (r.failure()?.errorText === "net::ERR_ABORTED" && /\/api\/v1\/catalog\/apply\?dry_run=true$/.test(r.url())) return;
    problems.push(`request failed: ${r.method()} ${r.url()}: ${r.failure()?.errorText}`);
  });
  page.on("response", (r) => {
    if (r.status() < 400) return;
    const method = r.request().method();
    if (EXPECTED_ERRORS.some((e) => e.status === r.status() && e.method === method && e.path.test(r.url()))) return;
    problems.push(`HTTP ${r.status()} for ${method} ${r.url()}`);
  });
  const api = context.request;
  const auth = token ? { Authorization: `Bearer ${token}` } : {};
  page.setDefaultTimeout(10000);
  let fnUploaded = false;
  const clusterLink = page.getByRole("navigation", { name: "Sections" }).getByRole("link", { name: "Cluster" });
  const channelsLink = page.getByRole("navigation", { name: "Sections" }).getByRole("link", { name: "Channels" });
  try {
    step = "open the console";
    const answer = await page.goto(`${base}/console`);
    check(answer.ok(), `GET /console answered ${answer.status()}`);
    check(page.url().endsWith("/console/#/channels"), `not redirected to the app: ${page.url()}`);
    const csp = (await api.get(`${base}/console/`)).headers()["content-security-policy"];
    check(csp && csp.includes("default-src 'self'"), `no CSP on the console: ${csp}`);
    if (token) {
      await page.getByLabel("Admin token").fill(token);
      await page.getByRole("button", { name: "Sign in" }).click();
    }
    await page.getByRole("heading", { name: "Channels", level: 1 }).waitFor();

    step = "create a bus";
    await page.getByRole("button", { name: "New bus" }).first().click();
    const dialog = page.getByRole("dialog", { name: "New bus" });
    await dialog.getByLabel("Name").fill(bus);
    await dialog.getByLabel("Shards").fill("2");
    await dialog.getByLabel("Retention", { exact: true }).fill("1h");
    await dialog.getByLabel("Retention (bytes)").fill("1073741824");
    await dialog.getByLabel("Max backlog age").fill("72h");
    await dialog.getByRole("button", { name: "Create bus" }).click();
    await page.getByRole("heading", { name: `Bus ${bus}` }).waitFor();
    const savedBus = await (await api.get(`${base}/api/v1/buses/${bus}`, { headers: auth })).json();
    check(savedBus.retention_bytes === 1073741824 && savedBus.max_backlog_age === "259200000ms", `the bus was saved with ${JSON.stringify(savedBus)}`);

    step = "a RocketMQ source feeding the bus (through the API)";
    const created = await api.put(`${base}/api/v1/sources/${mqSource}`, {
      headers: { ...auth, "content-type": "application/json" },
      data: { type: "rocketmq", bus, name_server: "127.0.0.1:9", topic: "smoke-orders" },
    });
    check(created.status() === 201, `PUT source: ${created.status()} ${await created.text()}`);
    // Paused: there is no RocketMQ here. (The catalog change takes effect within a second.)
    await waitFor(async () => (await api.post(`${base}/api/v1/sources/${mqSource}/pause`, { headers: auth })).status() === 202, 5000, "the source cannot be paused");

    step = "open the builder for a new rule";
    await page.getByRole("link", { name: `New rule on bus ${bus}` }).click();
    await page.getByRole("heading", { name: "New rule", level: 1 }).waitFor();
    await page.getByLabel("Rule name").fill(rule);

    step = "the sources of the bus: its ingress and the RocketMQ source";
    const ingress = page.getByRole("group", { name: `Ingress: ${bus}` });
    const mqNode = page.getByRole("group", { name: `RocketMQ source: ${mqSource}` });
    await ingress.waitFor();
    await mqNode.waitFor();
    await ingress.locator(".node__body").click();
    await page.locator(".inspector").getByText(`POST /buses/${bus}/events`).first().waitFor();
    await page.locator(".inspector .source-hint").filter({ hasText: `The rule applies to every event of bus ${bus}, whichever source stored it` }).waitFor();

    step = "edit the RocketMQ source's topic in its form";
    await mqNode.locator(".node__body").click();
    const mqForm = page.getByRole("form", { name: `RocketMQ source ${mqSource}` });
    const topic = mqForm.getByLabel("Topic");
    check((await topic.inputValue()) === "smoke-orders", `topic shown: ${await topic.inputValue()}`);
    check(await mqForm.getByRole("button", { name: "Save source" }).isDisabled(), "Save source is enabled before any change");
    await topic.fill("");
    await mqForm.locator(".field__error").filter({ hasText: "Topic is required" }).first().waitFor();
    await topic.fill("smoke-orders-v2");
    // A setting the gateway refuses: its answer is shown at the field.
    const tasks = mqForm.getByLabel("Tasks");
    await tasks.fill("0");
    await mqForm.getByRole("button", { name: "Save source" }).click();
    await mqForm.locator(".field__error").filter({ hasText: /task/i }).first().waitFor();
    await tasks.fill("1");
    await mqNode.locator(".node__meta").filter({ hasText: "topic smoke-orders-v2" }).waitFor();
    await mqNode.getByText("not saved").waitFor();
    await mqForm.getByRole("button", { name: "Save source" }).click();
    await page.locator("#status").filter({ hasText: `Saved source ${mqSource}` }).waitFor();
    await mqForm.locator('.source-form__status[data-state="saved"]').waitFor();
    const savedSource = await (await api.get(`${base}/api/v1/sources/${mqSource}`, { headers: auth })).json();
    check(savedSource.topic === "smoke-orders-v2" && savedSource.name_server === "127.0.0.1:9", `saved source: ${JSON.stringify(savedSource)}`);

    step = "set the filter";
    await page.locator(".node--filter .node__body").click();
    await page.getByLabel("Event pattern (JSON)").check();
    await page.locator('textarea[data-field="pattern"]').fill('{"type": ["com.example.smoke"]}');

    step = "drag a SET_ATTRIBUTES step from the palette";
    const canvas = page.locator(".canvas-wrap");
    await page.locator('.palette__item[data-value="SET_ATTRIBUTES"]').dragTo(canvas, { targetPosition: { x: 560, y: 300 } });
    const stepNode = page.locator(".node--step").first();
    await stepNode.waitFor();
    await page.locator('textarea[data-field="attributes"]').fill('{"subject": "$.data.id"}');

    step = "connect the filter to the step by dragging port to port";
    await dragPort(page, page.locator(".node--filter .port--out"), stepNode.locator(".port--in"));
    // Two sources → filter, filter → step.
    await page.waitForFunction(() => document.querySelectorAll(".edges path.edge").length >= 3);

    step = "add a log target by keyboard after the selected step";
    await stepNode.locator(".node__body").click();
    await page.getByRole("button", { name: "Add a log target after the selected node" }).focus();
    await page.keyboard.press("Enter");
    await page.locator(".node--target").first().waitFor();

    step = "reconnect the target by keyboard (Input from)";
    await page.locator(".node--target .node__body").first().focus();
    await page.keyboard.press("Enter");
    await page.locator('[data-connect="input"]').selectOption({ label: "Filter: Pattern" });
    await page.locator(".node--step.has-error").waitFor();
    await page.locator('[data-connect="input"]').selectOption({ label: "Step 1: SET_ATTRIBUTES" });
    await page.locator(".node--step.has-error").waitFor({ state: "detached" });

    step = "an invalid target is shown at its node";
    await page.locator(".node--step .node__body").first().click();
    await page.getByRole("button", { name: "Add a http target after the selected node" }).click();
    await page.locator(".node--target.has-error").waitFor();
    check(await page.locator(".problems").isVisible(), "no problem list for the invalid target");
    await shot(page, "builder-invalid");
    await page.locator(".node--target.has-error .node__body").focus();
    await page.keyboard.press("Delete");
    await page.locator(".node--target.has-error").waitFor({ state: "detached" });

    step = "drag a file target from the palette and connect the step to it";
    const stepBox = await stepNode.boundingBox();
    const wrapBox = await canvas.boundingBox();
    await page.locator('.palette__item[data-value="file"]').dragTo(canvas, {
      targetPosition: { x: stepBox.x - wrapBox.x + stepBox.width + 160, y: Math.max(50, stepBox.y - wrapBox.y - 70) },
    });
    const fileNode = page.locator(".node--target", { has: page.locator(".node__kind", { hasText: "Target · file" }) });
    await fileNode.waitFor();
    await dragPort(page, stepNode.locator(".port--out"), fileNode.locator(".port--in"));
    await page.waitForFunction(() => document.querySelectorAll(".edges path.edge").length >= 5);
    const fileTarget = (await fileNode.locator(".node__title").textContent()).trim();

    step = "save";
    await page.locator('.validation[data-state="valid"]').waitFor();
    await page.getByRole("button", { name: "Save", exact: true }).click();
    await page.locator("#status").filter({ hasText: `Created rule ${rule}` }).waitFor();
    check(page.url().endsWith(`#/builder/${bus}/${rule}`), `not at the saved rule: ${page.url()}`);
    const saved = await (await api.get(`${base}/api/v1/buses/${bus}/rules/${rule}`, { headers: auth })).json();
    check(saved.pattern?.type?.[0] === "com.example.smoke", `saved pattern: ${JSON.stringify(saved)}`);
    check(saved.targets.map((t) => t.type).join() === "log,file", `saved targets: ${JSON.stringify(saved.targets)}`);
    for (const t of saved.targets) {
      const steps = t.transform;
      check(steps?.length === 1 && steps[0].form === "SET_ATTRIBUTES" && steps[0].attributes?.subject === "$.data.id", `saved transform of ${t.name}: ${JSON.stringify(steps)}`);
    }
    check(saved.targets[1].name === fileTarget && saved.targets[1].path === `{data_dir}/${fileTarget}.jsonl`, `saved file target: ${JSON.stringify(saved.targets[1])}`);

    step = "test the channel on a sample event";
    await page.getByText("Test with an event").click();
    await page.getByLabel("Event (structured CloudEvent JSON)").fill(JSON.stringify({ specversion: "1.0", id: "t-1", source: "/smoke", type: "com.example.smoke", data: { id: "X-1" } }));
    await page.getByLabel("Chain of target").selectOption({ label: `${fileTarget} (file)` });
    await page.getByRole("button", { name: "Run test" }).click();
    await page.locator(".test-step--pass").filter({ hasText: "Matched" }).waitFor();
    await page.locator(".test-steps").filter({ hasText: '"subject": "X-1"' }).waitFor();
    await page.locator(".test-step--pass").filter({ hasText: fileTarget }).waitFor();
    await page.getByRole("button", { name: "Tidy layout" }).click();
    await page.getByRole("button", { name: "Fit" }).click();
    await shot(page, "builder");

    step = "post events to the bus (to both replicas)";
    const ids = [1, 2, 3].map((i) => `smoke-${stamp}-${i}`);
    for (const [i, id] of ids.entries()) {
      const to = i === 2 && base2 ? base2 : base;
      const posted = await api.post(`${to}/buses/${bus}/events`, {
        headers: { "ce-specversion": "1.0", "ce-id": id, "ce-source": "/smoke", "ce-type": "com.example.smoke", "content-type": "application/json" },
        data: JSON.stringify({ id: `X-${i + 2}` }),
      });
      check(posted.status() === 202, `POST event ${id} to ${to}: ${posted.status()}`);
    }
    // And to bus default, whose rule all-events (from the start, so in every sample of the
    // delivery rate) counts them in its throughput.
    for (const i of [1, 2, 3, 4, 5, 6]) {
      const posted = await api.post(`${base}/buses/default/events`, {
        headers: { "ce-specversion": "1.0", "ce-id": `smoke-${stamp}-default-${i}`, "ce-source": "/smoke", "ce-type": "com.example.smoke", "content-type": "application/json" },
        data: JSON.stringify({ id: `D-${i}` }),
      });
      check(posted.status() === 202, `POST event ${i} to bus default: ${posted.status()}`);
    }

    step = "the events view shows them delivered and counted";
    await page.goto(`${base}/console/#/events/${bus}`);
    await page.locator(".event__id").filter({ hasText: ids[0] }).waitFor();
    await waitFor(async () => {
      await page.locator(".events-view .view-header").getByRole("button", { name: "Refresh", exact: true }).click();
      await page.waitForTimeout(300);
      const rows = await page.locator(".events__list > li").evaluateAll((lis) =>
        lis.map((li) => ({ id: li.querySelector(".event__id .clip")?.textContent, state: li.querySelector(".event__deliveries .badge")?.textContent, of: li.querySelector(".event__deliveries .muted")?.textContent?.trim() })),
      );
      return ids.every((id) => rows.some((r) => r.id === id && r.state === "delivered" && r.of === "2/2"));
    }, 15000, "the posted events are not all shown delivered to both targets");
    await page.locator(".events-view [role=status]").filter({ hasText: "3 events" }).waitFor();
    await page.locator(".event__summary").first().click();
    await shot(page, "events");

    step = "the channels view shows the connectors with state, lag and throughput";
    await channelsLink.click();
    await page.getByRole("link", { name: `Open rule ${rule} in the builder` }).waitFor();
    const fileState = page.locator(`li[data-connector="${bus}/${rule}/${fileTarget}"]`);
    await fileState.locator(".badge", { hasText: "RUNNING" }).waitFor({ timeout: 15000 });
    await fileState.locator(".lag").waitFor();
    await fileState.locator(".rate").waitFor();
    await page.getByRole("columnheader", { name: "Targets: state, lag and throughput" }).first().waitFor();
    await shot(page, "channels");

    step = "the cluster view: both workers with their heartbeat, the connector's lag and rate";
    const w1 = (await (await api.get(`${base}/api/v1/cluster`, { headers: auth })).json()).worker;
    const w2 = base2 ? (await (await api.get(`${base2}/api/v1/cluster`, { headers: auth })).json()).worker : null;
    check(w1 && w1 !== w2, `worker ids: ${w1} and ${w2}`);
    await clusterLink.click();
    await page.getByRole("heading", { name: "Workers and their tasks" }).waitFor();
    const connector = `${bus}/${rule}/${fileTarget}`;
    const card = page.getByRole("article", { name: `Connector ${connector}` });
    await card.locator(".connector__lag .lag").waitFor();
    await card.locator(".connector__rate .rate").waitFor();
    for (const w of [w1, w2].filter(Boolean)) {
      await page.getByRole("region", { name: `Worker ${w}` }).locator(".worker__heartbeat").filter({ hasText: /^heartbeat \d/ }).waitFor();
    }
    // The rate is sampled every 5 s once asked (the console asked from its first page): the
    // new connector has a measured rate (a number) soon, and default/all-events counts the
    // events posted to bus default.
    await card.locator(".connector__rate .rate:not(.rate--unknown)").waitFor({ timeout: 12000 });
    const seeded = page.getByRole("article", { name: "Connector default/all-events/delivered" });
    await seeded.locator(".connector__rate .rate--flowing").waitFor({ timeout: 12000 });
    await shot(page, "cluster");

    step = "pause and resume the connector from the cluster view";
    await page.getByRole("button", { name: `Pause ${connector}` }).click();
    await card.locator(".connector__state .badge", { hasText: "PAUSED" }).waitFor({ timeout: 15000 });
    await shot(page, "cluster-paused");
    await page.getByRole("button", { name: `Resume ${connector}` }).click();
    await card.locator(".connector__state .badge", { hasText: "RUNNING" }).waitFor({ timeout: 15000 });

    if (base2 && pid2) {
      step = "kill the second replica: its tasks move to the first within 20 s";
      await page.getByRole("region", { name: `Worker ${w2}` }).waitFor();
      const killed = Date.now();
      process.kill(pid2, "SIGKILL");
      // Between 2 s (late) and member_ttl (3 s, gone) its heartbeat is shown as late: asked
      // for at about 2.3 s. Timing on a busy machine may miss it, so it is only reported.
      await page.waitForTimeout(2300);
      await page.getByRole("button", { name: "Refresh now" }).click();
      const late = page.getByRole("region", { name: `Worker ${w2}` }).locator(".worker__heartbeat.is-late");
      if (await late.waitFor({ timeout: 1500 }).then(() => true, () => false)) await shot(page, "cluster-late-heartbeat");
      else console.log("(the late heartbeat of the killed worker was not caught on screen)");
      await page.getByRole("region", { name: `Worker ${w2}` }).waitFor({ state: "detached", timeout: 20000 });
      await waitFor(async () => {
        const workers = await page.locator(".connector .tasks tbody .task__worker").evaluateAll((cells) => cells.map((c) => c.textContent.trim()));
        const holders = await page.locator(".worker[aria-label^='Worker ']").evaluateAll((cards) => cards.filter((c) => c.querySelector(".task")).map((c) => c.getAttribute("aria-label")));
        return workers.length > 0 && workers.every((w) => w === w1) && holders.every((h) => h === `Worker ${w1}`);
      }, Math.max(1000, 20000 - (Date.now() - killed)), `not every task shows worker ${w1} within 20 s of the kill`);
      const took = Date.now() - killed;
      await card.locator(".connector__state .badge", { hasText: "RUNNING" }).waitFor();
      await shot(page, "cluster-takeover");
      console.log(`takeover seen in the console ${seconds(took)} after the kill`);
    }

    step = "a function step (WASM) in the builder";
    const component = await readFile(functionComponent).catch(() => null);
    if (component) {
      const put = await api.put(`${base}/api/v1/functions/${fn}`, { headers: { ...auth, "content-type": "application/wasm" }, data: component });
      check(put.status() === 201 || put.status() === 200, `PUT function: ${put.status()} ${await put.text()}`);
      fnUploaded = true;
    } else {
      console.log(`(no component at ${functionComponent}: run \`make functions\` or set CONSOLE_FUNCTION; the function step is checked without a function)`);
    }
    const listed = await (await api.get(`${base}/api/v1/functions`, { headers: auth })).json();
    const fnItem = listed.items.find((f) => f.name === fn);
    check(!component || fnItem?.sha256, `function ${fn} not listed: ${JSON.stringify(listed)}`);
    await page.goto(`${base}/console/#/builder/${bus}/${rule}`);
    const setNode = page.locator(".node--step", { has: page.locator(".node__title", { hasText: "SET_ATTRIBUTES" }) });
    await setNode.waitFor();
    const wasmItem = page.locator('.palette__item[data-value="WASM"]');
    check((await wasmItem.locator(".palette__name").textContent()).trim() === "Function (WASM)", "no Function (WASM) item in the palette");
    await wasmItem.getByText("Runs a WebAssembly function of the catalog").waitFor();
    await setNode.locator(".node__body").click();
    // What the builder sends for it (to the dry run): exactly {"wasm": ""} while none is chosen.
    const sent = page.waitForRequest((r) => /\/api\/v1\/catalog\/apply\?dry_run=true$/.test(r.url()) && (r.postData() || "").includes('"wasm"'));
    await page.getByRole("button", { name: "Add a Function (WASM) step after the selected node" }).click();
    const wasmNode = page.locator(".node--step", { has: page.locator(".node__title", { hasText: "Function (WASM)" }) });
    await wasmNode.waitFor();
    const draft = JSON.parse((await sent).postData());
    for (const t of draft.rules[0].targets) {
      check(t.transform?.length === 2 && t.transform[0].form === "SET_ATTRIBUTES" && JSON.stringify(t.transform[1]) === '{"wasm":""}', `transform sent for ${t.name}: ${JSON.stringify(t.transform)}`);
    }
    await wasmNode.locator(".node__error").filter({ hasText: "Choose the function this step calls" }).waitFor();
    const fnSelect = page.locator('.inspector [data-field="wasm"]');
    await fnSelect.waitFor();
    if (!listed.items.length) {
      await page.locator(".inspector .notice--warn").filter({ hasText: "No functions yet: upload one with PUT /api/v1/functions/{name} or sluice ctl apply" }).waitFor();
    }
    if (component) {
      await fnSelect.selectOption(fn);
      const option = await page.locator('.inspector [data-field="wasm"] option:checked').textContent();
      check(option.includes(fn) && option.includes(fnItem.sha256.slice(0, 12)), `the function's option: ${option}`);
      await wasmNode.locator(".node__meta").filter({ hasText: fn }).waitFor();
      await page.locator(".inspector .function-info .facts").getByText(fnItem.sha256.slice(0, 12)).waitFor();
      await page.locator('.validation[data-state="valid"]').waitFor();
      await page.getByRole("button", { name: "Save", exact: true }).click();
      await page.locator("#status").filter({ hasText: `Saved rule ${rule}` }).waitFor();
      const withFn = await (await api.get(`${base}/api/v1/buses/${bus}/rules/${rule}`, { headers: auth })).json();
      for (const t of withFn.targets) {
        check(
          t.transform?.length === 2 && t.transform[0].form === "SET_ATTRIBUTES" && JSON.stringify(t.transform[1]) === JSON.stringify({ wasm: fn }),
          `saved transform of ${t.name}: ${JSON.stringify(t.transform)}`,
        );
      }

      step = "the function step loaded back, and tested";
      await page.reload();
      await wasmNode.locator(".node__meta").filter({ hasText: fn }).waitFor();
      check((await page.locator(".node--step").count()) === 2, "the two targets' chains are not shared as SET_ATTRIBUTES → Function (WASM)");
      // The test waits for the function to load on this replica (a debug build compiles slowly).
      await waitFor(async () => {
        const item = (await (await api.get(`${base}/api/v1/functions`, { headers: auth })).json()).items.find((f) => f.name === fn);
        check(!item?.loaded?.error, `function ${fn} cannot be loaded: ${item?.loaded?.error}`);
        return item?.loaded?.running === fnItem.sha256;
      }, 60000, `function ${fn} is not loaded on the replica within 60 s`);
      await page.getByText("Test with an event").click();
      const eventField = page.getByLabel("Event (structured CloudEvent JSON)");
      await eventField.fill(JSON.stringify({ specversion: "1.0", id: "t-2", source: "/smoke", type: "com.example.smoke", data: { id: "X-9", country: "DE", amount: 100 } }));
      await page.getByLabel("Chain of target").selectOption({ label: `${fileTarget} (file)` });
      await page.getByRole("button", { name: "Run test" }).click();
      await page.locator(".test-step--pass").filter({ hasText: fn }).filter({ hasText: "Returned 1 event" }).waitFor({ timeout: 30000 });
      await page.locator(".test-steps").filter({ hasText: '"region": "emea"' }).filter({ hasText: '"subject": "X-9"' }).waitFor();
      await page.locator(".test-step--pass").filter({ hasText: fileTarget }).filter({ hasText: "Receives" }).waitFor();
      await wasmNode.locator(".test-mark--pass").waitFor();
      await shot(page, "builder-wasm");
      // An unknown country is the function's error: the event would be dead-lettered.
      await eventField.fill(JSON.stringify({ specversion: "1.0", id: "t-3", source: "/smoke", type: "com.example.smoke", data: { id: "X-10", country: "ZZ" } }));
      await page.getByRole("button", { name: "Run test" }).click();
      await page.locator(".test-step--fail").filter({ hasText: fn }).waitFor({ timeout: 30000 });
      await page.locator(".test-steps").filter({ hasText: "dead-lettered" }).waitFor();
      await wasmNode.locator(".test-mark--fail").waitFor();
    } else {
      // Nothing to save without a function: remove it and load the rule as saved.
      await wasmNode.locator(".node__body").focus();
      await page.keyboard.press("Delete");
      await wasmNode.waitFor({ state: "detached" });
      await page.getByRole("button", { name: "Reload", exact: true }).click();
      await page.getByRole("dialog", { name: "Reload the rule?" }).getByRole("button", { name: "Reload" }).click();
      await setNode.waitFor();
      check((await page.locator(".node--step").count()) === 1, "the rule as saved has one step");
    }

    step = "the webhook source of bus default, in the builder";
    await page.goto(`${base}/console/#/builder/default/all-events`);
    const hook = page.getByRole("group", { name: "Webhook source: console-hook" });
    await hook.waitFor();
    await hook.locator(".node__body").click();
    const facts = page.locator(".inspector .facts");
    await facts.getByText("POST /webhooks/console-hook").waitFor();
    await facts.locator("code", { hasText: "none" }).waitFor();
    await facts.getByText("this replica's configuration file").waitFor();
    await page.locator(".inspector").getByText("Read-only here: a webhook source comes from a replica's configuration file").waitFor();
    check((await page.locator(".inspector input, .inspector textarea").count()) === 0, "the webhook source is editable");
    await shot(page, "builder-sources");

    step = "narrow screen";
    await page.setViewportSize({ width: 900, height: 900 });
    await page.goto(`${base}/console/#/builder/${bus}/${rule}`);
    await page.locator(".node--target").first().waitFor();
    await shot(page, "builder-narrow");
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
    check(overflow <= 1, `the page scrolls sideways by ${overflow}px at 900px`);

    check(!problems.length, `browser problems:\n${problems.join("\n")}`);
    console.log(`console smoke test passed in ${seconds(Date.now() - started)} (${base}${base2 ? `, ${base2}` : ""}); screenshots in ${shots}/console-*.png`);
  } catch (err) {
    await page.screenshot({ path: `${shots}/console-failure.png`, fullPage: true }).catch(() => {});
    console.error(`console smoke test failed at "${step}" after ${seconds(Date.now() - started)}: ${err.message}`);
    if (problems.length) console.error(`browser problems:\n${problems.join("\n")}`);
    process.exitCode = 1;
  } finally {
    await api.delete(`${base}/api/v1/buses/${bus}/rules/${rule}`, { headers: auth }).catch(() => {});
    if (fnUploaded) await api.delete(`${base}/api/v1/functions/${fn}`, { headers: auth }).catch(() => {});
    await api.delete(`${base}/api/v1/sources/${mqSource}`, { headers: auth }).catch(() => {});
    await api.delete(`${base}/api/v1/buses/${bus}`, { headers: auth }).catch(() => {});
    await browser.close();
  }
}

/** Drags from one port to another with the mouse, the way a user connects two nodes. */
async function dragPort(page, fromPort, toPort) {
  const from = await fromPort.boundingBox();
  const to = await toPort.boundingBox();
  await page.mouse.move(from.x + from.width / 2, from.y + from.height / 2);
  await page.mouse.down();
  await page.mouse.move(from.x + 60, from.y + 40, { steps: 5 });
  await page.mouse.move(to.x + to.width / 2, to.y + to.height / 2, { steps: 10 });
  await page.mouse.up();
}

/** Polls `condition` until it holds, or fails with `message` after `timeout` ms. */
async function waitFor(condition, timeout, message) {
  const end = Date.now() + timeout;
  for (;;) {
    if (await condition()) return;
    if (Date.now() > end) throw new Error(message);
    await new Promise((r) => setTimeout(r, 250));
  }
}

main();
