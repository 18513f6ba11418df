// Checks the Rust example without the gateway: the component's imports (printed: the
// gateway must link each of them, as a stub that traps when called) and `handle` called
// from node on sample events, every import a stub that throws (jco transpiles it; the
// tools are those of examples/functions/js, see harness.mjs there).
//
//   node check.mjs [FILE]   (default target/wasm32-wasip2/release/country_lookup.wasm)
//
// Ends with "N passed, N failed"; exits 1 on any failure.
import { deepStrictEqual, strictEqual } from "node:assert/strict";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { call, check, describe, done, instantiate } from "../js/harness.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const file = resolve(process.argv[2] ?? join(here, "target/wasm32-wasip2/release/country_lookup.wasm"));
const fn = await instantiate(file, "country_lookup");
await describe(fn, "country_lookup.wasm");

const event = (data) => ({ specversion: "1.0", id: "o-1", source: "/shop", type: "com.example.order", data });
await check("looks the country up: region, countryName, vat", () => {
  deepStrictEqual(call(fn.handle, event({ country: "de", amount: 12.34 })), {
    ok: [{ ...event({ country: "de", amount: 12.34, vat: 2.34, countryName: "Germany" }), region: "emea" }],
  });
});
await check("drops a test order and one under the country's minimum", () => {
  deepStrictEqual(call(fn.handle, event({ country: "DE", test: true })), { ok: [] });
  deepStrictEqual(call(fn.handle, event({ country: "US", amount: 4.99 })), { ok: [] });
});
await check("err for an unknown country", () => {
  deepStrictEqual(call(fn.handle, event({ country: "XX" })), { err: 'event o-1: unknown country code "XX"' });
});
await check("err when data is not an object, and for input that is not JSON", () => {
  deepStrictEqual(call(fn.handle, event("text")), { err: "data of event o-1 is not a JSON object" });
  strictEqual(call(fn.handle, "{not json").err?.startsWith("the event is not a JSON object"), true);
});
await check("no import was called (Rust's std links WASI, this code never uses it)", () => {
  deepStrictEqual(fn.denied, []);
});

done();
