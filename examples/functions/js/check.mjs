// Checks the built JavaScript example functions without the gateway: each component's
// imports and its `handle` export, then `handle` called from node on sample events (jco
// transpiles the component; every import is a stub that throws, as in the gateway).
//
//   node check.mjs [DIR]     DIR holds enrich.wasm and split-order.wasm (default target/functions)
//
// Ends with "N passed, N failed"; exits 1 on any failure.
import { deepStrictEqual, strictEqual } from "node:assert/strict";
import { join, resolve } from "node:path";
import { call, check, describe, done, instantiate } from "./harness.mjs";

const dir = resolve(process.argv[2] ?? "target/functions");

async function load(name) {
  const component = await instantiate(join(dir, `${name}.wasm`), name);
  await describe(component, `${name}.wasm`);
  // Built with every componentize-js feature disabled, a JS component imports nothing.
  await check(`${name}: imports nothing (the gateway grants no WASI)`, () => {
    deepStrictEqual(component.imports, []);
  });
  return component;
}

const order = {
  specversion: "1.0",
  id: "o-1",
  source: "/shop",
  type: "com.example.order.created",
  subject: "eu",
  region: "eu",
  datacontenttype: "application/json",
  data: {
    orderId: "A-17",
    items: [
      { sku: "pen", price: 2.5, qty: 2 },
      { sku: "ink", price: 0.1, qty: 3 },
      { sku: "pad", price: 4 },
    ],
  },
};
const plain = { specversion: "1.0", id: "p-1", source: "/shop", type: "com.example.ping", data: { a: 1 } };

const enrich = await load("enrich");
const notObject = { err: "data of event p-1 is not a JSON object" };
await check("enrich: maps an order to one event with data.total and enriched", () => {
  deepStrictEqual(call(enrich.handle, order), {
    ok: [{ ...order, enriched: "true", data: { ...order.data, total: 9.3 } }],
  });
});
await check("enrich: maps an event without items (no total)", () => {
  deepStrictEqual(call(enrich.handle, plain), { ok: [{ ...plain, enriched: "true" }] });
});
await check("enrich: err when data is not a JSON object", () => {
  const { data, ...noData } = plain;
  deepStrictEqual(call(enrich.handle, { ...plain, data: "text" }), notObject);
  deepStrictEqual(call(enrich.handle, { ...plain, data: [1] }), notObject);
  deepStrictEqual(call(enrich.handle, noData), notObject);
});
await check("enrich: err when an item has no numeric price", () => {
  const bad = { ...order, data: { items: [{ price: "x" }] } };
  deepStrictEqual(call(enrich.handle, bad), { err: "data.items[0] has no numeric price and qty" });
});
await check("enrich: err on input that is not JSON", () => {
  const { err } = call(enrich.handle, "{not json");
  strictEqual(err?.startsWith("the event is not JSON"), true, String(err));
});

const split = await load("split-order");
await check("split-order: fans an order of 3 items out to 3 events, in order", () => {
  const { datacontenttype, data, ...attrs } = order;
  deepStrictEqual(call(split.handle, order), {
    ok: order.data.items.map((item, i) => ({
      ...attrs,
      id: `o-1-${i}`,
      type: "com.example.order.created.item",
      datacontenttype: "application/json",
      data: { ...item, orderId: "A-17" },
    })),
  });
});
await check("split-order: orderId defaults to the event id", () => {
  const { ok } = call(split.handle, { ...plain, data: { items: [{ sku: "x" }] } });
  deepStrictEqual(ok.map((e) => [e.id, e.data]), [["p-1-0", { sku: "x", orderId: "p-1" }]]);
});
await check("split-order: drops an event without items (empty list)", () => {
  deepStrictEqual(call(split.handle, plain), { ok: [] });
  deepStrictEqual(call(split.handle, { ...plain, data: { items: [] } }), { ok: [] });
});
await check("split-order: err when an item is not an object", () => {
  deepStrictEqual(call(split.handle, { ...plain, data: { items: [{}, 3] } }), {
    err: "data.items[1] of order p-1 is not a JSON object",
  });
});
await check("split-order: the same instance still works after an err", () => {
  strictEqual(call(split.handle, order).ok.length, 3);
});
await check("no import was called", () => {
  deepStrictEqual([...enrich.denied, ...split.denied], []);
});

done();
