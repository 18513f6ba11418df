// Builds the example functions into WebAssembly components with componentize-js.
//
//   node build.mjs [OUT_DIR] [NAME...]
//
// OUT_DIR defaults to target/functions (relative to the current directory); NAME is
// enrich, split-order or stamp (default: all). Writes OUT_DIR/NAME.wasm.
//
// For enrich and split-order every WASI feature is disabled: the component imports
// nothing, and needs no grant. stamp keeps the clocks and randomness (its function needs
// `grants = ["clocks", "random"]`). None can use timers, console output or fetch.
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { load } from "./harness.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const witPath = join(here, "..", "..", "..", "schemas", "wit", "function.wit");
const [outArg, ...names] = process.argv.slice(2);
const outDir = resolve(outArg ?? "target/functions");
const functions = names.length ? names : ["enrich", "split-order", "stamp"];
// The WASI features each keeps (the gateway grants these only when configured to).
const keeps = { stamp: ["clocks", "random"] };
const allFeatures = ["random", "stdio", "clocks", "http", "fetch-event"];

const { componentize } = await load("@bytecodealliance/componentize-js");
// The WIT file's text, not its path (witPath): the world is passed inline.
const witWorld = await readFile(witPath, "utf8");
await mkdir(outDir, { recursive: true });

for (const name of functions) {
  const started = Date.now();
  const { component, imports } = await componentize({
    sourcePath: join(here, `${name}.js`),
    witWorld,
    worldName: "transform",
    disableFeatures: allFeatures.filter((f) => !(keeps[name] ?? []).includes(f)),
  });
  const out = join(outDir, `${name}.wasm`);
  await writeFile(out, component);
  const seconds = ((Date.now() - started) / 1000).toFixed(1);
  const mib = (component.length / 1048576).toFixed(1);
  console.log(`${out}: ${mib} MiB in ${seconds} s; world imports: ${JSON.stringify(imports)}`);
}
