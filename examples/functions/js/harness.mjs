// What build.mjs and the checks share: loading the npm tools, and running a component's
// `handle` from node without the gateway (jco transpiles it to JavaScript) with every
// import it has linked to a stub that throws, as the gateway links WASI (it grants none).
import { mkdir, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { pathToFileURL } from "node:url";

// Loads an npm package: from FUNCTIONS_NODE_DIR/node_modules when that variable is set
// (`make functions` installs the tools into a cache directory outside the repository),
// otherwise the usual way (after `npm install` in examples/functions/js).
export async function load(name) {
  const dir = process.env.FUNCTIONS_NODE_DIR;
  if (!dir) {
    return import(name);
  }
  const root = join(dir, "node_modules", name);
  const pkg = JSON.parse(await readFile(join(root, "package.json"), "utf8"));
  let entry = pkg.exports?.["."] ?? pkg.exports ?? pkg.main;
  if (typeof entry === "object") {
    entry = entry.import ?? entry.default;
  }
  return import(pathToFileURL(join(root, entry ?? "index.js")).href);
}

// Loads the component at `path`: its WIT, its imports as WIT names with versions
// (wasi:io/streams@0.2.6, ...), its exports, and `handle` from an instance whose imports
// all throw. `denied` lists the imported functions that were called.
export async function instantiate(path, name) {
  const { componentWit, transpile } = await load("@bytecodealliance/jco");
  const bytes = await readFile(path);
  const wit = await componentWit(bytes);
  const imports = wit
    .split("\n")
    .filter((l) => /^\s*import\s/.test(l))
    .map((l) => l.trim().replace(/^import\s+/, "").replace(/;$/, ""));
  const { files, exports } = await transpile(bytes, {
    name,
    instantiation: "async",
    quiet: true,
  });
  const dir = await mkdtemp(join(tmpdir(), `sluice-fn-${name}-`));
  try {
    await writeFile(join(dir, "package.json"), '{"type":"module"}');
    for (const [file, content] of Object.entries(files)) {
      await mkdir(dirname(join(dir, file)), { recursive: true });
      await writeFile(join(dir, file), content);
    }
    const module = await import(pathToFileURL(join(dir, `${name}.js`)).href);
    const denied = [];
    const stubs = new Proxy(
      {},
      {
        get: (_, iface) =>
          new Proxy(
            {},
            {
              get: (_, fn) =>
                function () {
                  denied.push(`${String(iface)}#${String(fn)}`);
                  throw new Error(`${String(iface)}#${String(fn)} is not granted`);
                },
            },
          ),
      },
    );
    const cores = {};
    for (const file of Object.keys(files).filter((f) => f.endsWith(".wasm"))) {
      cores[file] = await WebAssembly.compile(files[file]);
    }
    const instance = await module.instantiate((file) => cores[file], stubs);
    return { bytes, wit, imports, exports, denied, handle: instance.handle };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

// Calls handle with an event (an object) and returns { ok: [events, parsed] } or
// { err: message }. jco's bindings return the list for ok(list) and throw a
// ComponentError whose payload is the message for err(message); a trap propagates.
export function call(handle, event) {
  try {
    return { ok: handle(typeof event === "string" ? event : JSON.stringify(event)).map((e) => JSON.parse(e)) };
  } catch (e) {
    if (e?.constructor?.name === "ComponentError") {
      return { err: e.payload };
    }
    throw e;
  }
}

// Named checks, counted; `done` prints "N passed, N failed" and sets the exit code.
let passed = 0;
let failed = 0;
export async function check(what, fn) {
  try {
    await fn();
    passed += 1;
    console.log(`ok   ${what}`);
  } catch (e) {
    failed += 1;
    console.log(`FAIL ${what}: ${e.message}`);
  }
}
export function done() {
  console.log(`${passed} passed, ${failed} failed`);
  process.exitCode = failed ? 1 : 0;
}

export const HANDLE = "export handle: func(event: string) -> result<list<string>, string>;";

// Prints what a component is and checks it exports handle with the contract's signature.
export async function describe(component, name) {
  const { bytes, wit, imports, exports } = component;
  const size = bytes.length >= 1048576 ? `${(bytes.length / 1048576).toFixed(1)} MiB` : `${(bytes.length / 1024).toFixed(0)} KiB`;
  console.log(`${name}: ${size}`);
  console.log(`  imports: ${imports.length ? imports.join(", ") : "none"}`);
  console.log(`  exports: ${exports.map(([n, kind]) => `${n} (${kind})`).join(", ")}`);
  await check(`${name}: exports handle with the contract's signature`, () => {
    if (JSON.stringify(exports) !== '[["handle","function"]]' || !wit.includes(HANDLE)) {
      throw new Error(`no "${HANDLE}" alone in:\n${wit}`);
    }
  });
}
