// Smoke test of the web console in a real browser: playwright-core driving the system's
// Chromium against a running gateway. Not run by `make test` (it needs a browser).
//
//   apt-get install -y chromium                      # Debian's Chromium
//   mkdir -p /tmp/pw && cd /tmp/pw && npm i playwright-core
//   ./target/debug/sluice serve --config sluice.example.toml --data-dir /tmp/console-data --listen 127.0.0.1:18080 &
//   cd /tmp/pw && node /path/to/repo/tests/console/smoke.mjs http://127.0.0.1:18080 [screenshot dir]
//
// playwright-core is loaded from the current directory's node_modules (or PLAYWRIGHT_CORE),
// Chromium from CHROMIUM (default /usr/bin/chromium). The gateway must answer the admin
// API without a token (loopback, no admin.tokens), or set SLUICE_ADMIN_TOKEN here too.
//
// It creates a bus and a rule (named console-smoke-*), exercises the builder (palette drag
// and keyboard add, port-to-port connection, validation at the node, save, test), posts an
// event, checks the channels, events and cluster views (pause, resume), takes screenshots
// (console-*.png) and deletes what it created. Any browser console error, page error or
// CSP violation fails it.

import { createRequire } from "node:module";
import path from "node:path";

const base = (process.argv[2] || "http://127.0.0.1:18080").replace(/\/$/, "");
const shots = process.argv[3] || "/tmp";
const require = createRequire(path.join(process.env.PLAYWRIGHT_CORE || process.cwd(), "noop.js"));
const { chromium } = require("playwright-core");

const stamp = Date.now().toString(36);
const bus = `console-smoke-${stamp}`;
const rule = "smoke-rule";
const token = process.env.SLUICE_ADMIN_TOKEN || "";
const problems = [];
let step = "start";

function check(condition, message) {
  if (!condition) throw new Error(message);
}

async function main() {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium", args: ["--no-sandbox"] });
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  const page = await context.newPage();
  page.on("console", (m) => {
    // The browser logs every 4xx answer; the console expects some (a dry run refusing an
    // invalid channel is 400). Other errors, and 5xx answers, are problems.
    if (m.type() === "error" && !/status of 4\d\d /.test(m.text())) problems.push(`console: ${m.text()}`);
  });
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  const api = context.request;
  const auth = token ? { Authorization: `Bearer ${token}` } : {};
  page.setDefaultTimeout(10000);
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
    await dialog.getByLabel("Retention").fill("1h");
    await dialog.getByRole("button", { name: "Create bus" }).click();
    await page.getByRole("heading", { name: `Bus ${bus}` }).waitFor();

    step = "open the builder for a new rule";
    await page.getByRole("link", { name: `New rule on bus ${bus}` }).click();
    await page.getByRole("heading", { name: "New rule", level: 1 }).waitFor();
    await page.getByLabel("Rule name").fill(rule);

    step = "set the filter";
    await page.locator(".node--filter .node__body").click();
    await page.getByLabel("Event pattern (JSON)").check();
    await page.locator('textarea[data-field="pattern"]').fill('{"type": ["com.example.smoke"]}');

    step = "drag a JSONPATH step from the palette";
    const canvas = page.locator(".canvas-wrap");
    await page.locator('.palette__item[data-value="SET_ATTRIBUTES"]').dragTo(canvas, { targetPosition: { x: 560, y: 320 } });
    const stepNode = page.locator(".node--step").first();
    await stepNode.waitFor();
    await page.locator('textarea[data-field="attributes"]').fill('{"subject": "$.data.id"}');

    step = "connect the filter to the step by dragging port to port";
    const from = await page.locator(".node--filter .port--out").boundingBox();
    const to = await stepNode.locator(".port--in").boundingBox();
    await page.mouse.move(from.x + from.width / 2, from.y + from.height / 2);
    await page.mouse.down();
    await page.mouse.move(from.x + 60, from.y + 40, { steps: 5 });
    await page.mouse.move(to.x + to.width / 2, to.y + to.height / 2, { steps: 10 });
    await page.mouse.up();
    await page.waitForFunction(() => document.querySelectorAll(".edges path.edge").length >= 2);

    step = "add a log target by keyboard after the selected step";
    await stepNode.locator(".node__body").click();
    await page.getByRole("button", { name: "Add a log target after the selected node" }).focus();
    await page.keyboard.press("Enter");
    await page.locator(".node--target").first().waitFor();

    step = "reconnect the target by keyboard (Input from)";
    await page.locator(".node--target .node__body").first().focus();
    await page.keyboard.press("Enter");
    const input = page.locator('[data-connect="input"]');
    await input.selectOption({ label: "Filter: Pattern" });
    await page.locator(".node--step.has-error").waitFor();
    await page.locator('[data-connect="input"]').selectOption({ label: "Step 1: SET_ATTRIBUTES" });
    await page.locator(".node--step.has-error").waitFor({ state: "detached" });

    step = "an invalid target is shown at its node";
    await page.locator(".node--step .node__body").first().click();
    await page.getByRole("button", { name: "Add a http target after the selected node" }).click();
    await page.locator(".node--target.has-error").waitFor();
    check(await page.locator(".problems").isVisible(), "no problem list for the invalid target");
    await page.screenshot({ path: `${shots}/console-builder-invalid.png` });
    await page.locator(".node--target.has-error .node__body").focus();
    await page.keyboard.press("Delete");
    await page.locator(".node--target.has-error").waitFor({ state: "detached" });

    step = "save";
    await page.locator('.validation[data-state="valid"]').waitFor();
    await page.getByRole("button", { name: "Save" }).click();
    await page.locator("#status").filter({ hasText: `Created rule ${rule}` }).waitFor();
    check(page.url().endsWith(`#/builder/${bus}/${rule}`), `not at the saved rule: ${page.url()}`);
    const saved = await (await api.get(`${base}/api/v1/buses/${bus}/rules/${rule}`, { headers: auth })).json();
    check(saved.pattern?.type?.[0] === "com.example.smoke", `saved pattern: ${JSON.stringify(saved)}`);
    check(saved.targets.length === 1 && saved.targets[0].type === "log", `saved targets: ${JSON.stringify(saved.targets)}`);
    const steps = saved.targets[0].transform;
    check(steps?.length === 1 && steps[0].form === "SET_ATTRIBUTES" && steps[0].attributes?.subject === "$.data.id", `saved transform: ${JSON.stringify(steps)}`);

    step = "test the rule on an event";
    await page.getByText("Test with an event").click();
    await page.getByLabel("Event (structured CloudEvent JSON)").fill(JSON.stringify({ specversion: "1.0", id: "t-1", source: "/smoke", type: "com.example.smoke", data: { id: "X-1" } }));
    await page.getByRole("button", { name: "Run test" }).click();
    await page.locator(".test-step--pass").filter({ hasText: "Matched" }).waitFor();
    await page.locator(".test-steps").filter({ hasText: '"subject": "X-1"' }).waitFor();
    await page.screenshot({ path: `${shots}/console-builder.png` });

    step = "post an event to the bus";
    const posted = await api.post(`${base}/buses/${bus}/events`, {
      headers: { "ce-specversion": "1.0", "ce-id": `smoke-${stamp}`, "ce-source": "/smoke", "ce-type": "com.example.smoke", "content-type": "application/json" },
      data: JSON.stringify({ id: "X-2" }),
    });
    check(posted.status() === 202, `POST event: ${posted.status()}`);

    step = "the rule in the channels view";
    await page.getByRole("navigation", { name: "Sections" }).getByRole("link", { name: "Channels" }).click();
    await page.getByRole("link", { name: `Open rule ${rule} in the builder` }).waitFor();
    await page.screenshot({ path: `${shots}/console-channels.png`, fullPage: true });

    step = "the event in the events view";
    await page.goto(`${base}/console/#/events/${bus}`);
    await page.locator(".event__id").filter({ hasText: `smoke-${stamp}` }).waitFor();
    await page.locator(".event__summary").first().click();
    await page.screenshot({ path: `${shots}/console-events.png`, fullPage: true });

    step = "the cluster view: pause and resume the new connector";
    await page.getByRole("navigation", { name: "Sections" }).getByRole("link", { name: "Cluster" }).click();
    await page.getByRole("heading", { name: "Workers and their tasks" }).waitFor();
    const connector = `${bus}/${rule}/log-1`;
    await page.getByRole("button", { name: `Pause ${connector}` }).click();
    const card = page.getByRole("article", { name: `Connector ${connector}` });
    await card.locator(".connector__state .badge", { hasText: "PAUSED" }).waitFor({ timeout: 15000 });
    await page.screenshot({ path: `${shots}/console-cluster.png`, fullPage: true });
    await page.getByRole("button", { name: `Resume ${connector}` }).click();
    await card.locator(".connector__state .badge", { hasText: "RUNNING" }).waitFor({ timeout: 15000 });

    step = "narrow screen";
    await page.setViewportSize({ width: 900, height: 900 });
    await page.goto(`${base}/console/#/builder/${bus}/${rule}`);
    await page.locator(".node--target").first().waitFor();
    await page.screenshot({ path: `${shots}/console-builder-narrow.png`, fullPage: true });
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
    check(overflow <= 1, `the page scrolls sideways by ${overflow}px at 900px`);

    check(!problems.length, `browser problems:\n${problems.join("\n")}`);
    console.log(`console smoke test passed (${base}); screenshots in ${shots}/console-*.png`);
  } catch (err) {
    await page.screenshot({ path: `${shots}/console-failure.png`, fullPage: true }).catch(() => {});
    console.error(`console smoke test failed at "${step}": ${err.message}`);
    if (problems.length) console.error(problems.join("\n"));
    process.exitCode = 1;
  } finally {
    await api.delete(`${base}/api/v1/buses/${bus}/rules/${rule}`, { headers: auth }).catch(() => {});
    await api.delete(`${base}/api/v1/buses/${bus}`, { headers: auth }).catch(() => {});
    await browser.close();
  }
}

main();
