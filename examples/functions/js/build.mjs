// Builds the example functions into WebAssembly components with componentize-js.
//
//   node build.mjs [OUT_DIR] [NAME...]
//
// OUT_DIR defaults to target/functions (relative to the current directory); NAME is
// enrich or split-order (default: both). Writes OUT_DIR/NAME.wasm.
//
// Every WASI feature is disabled: the component imports nothing, which is what the
// gateway links (it grants no WASI). A function built this way cannot use timers,
// console output, fetch, real clocks or real randomness.
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { load } from "./harness.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const witPath = join(here, "..", "..", "..", "schemas", "wit", "function.wit");
const [outArg, ...names] = process.argv.slice(2);
const outDir = resolve(outArg ?? "target/functions");
const functions = names.length ? names : ["enrich", "split-order"];

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
    disableFeatures: ["random", "stdio", "clocks", "http", "fetch-event"],
  });
  const out = join(outDir, `${name}.wasm`);
  await writeFile(out, component);
  const seconds = ((Date.now() - started) / 1000).toFixed(1);
  const mib = (component.length / 1048576).toFixed(1);
  console.log(`${out}: ${mib} MiB in ${seconds} s; world imports: ${JSON.stringify(imports)}`);
}
