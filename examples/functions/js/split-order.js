// A Sluice function that fans an order out: an event whose `data.items` is an
// array becomes one event per item, in order, with id `<order id>-<index>`,
// type `<order type>.item` and as data the item plus `orderId`. The other
// attributes (source, subject, extensions...) are copied. An event without
// items is dropped: the function returns an empty list.
//
// Contract: schemas/wit/function.wit. A thrown string is `err(message)` and
// dead-letters the event with that reason (see enrich.js).

export function handle(text) {
  let order;
  try {
    order = JSON.parse(text);
  } catch (e) {
    throw `the event is not JSON: ${e.message}`;
  }
  const items = order.data?.items;
  if (!Array.isArray(items)) {
    return [];
  }
  const { id, type, data, data_base64, datacontenttype, ...rest } = order;
  const orderId = data.orderId ?? id;
  return items.map((item, i) => {
    if (item === null || typeof item !== "object" || Array.isArray(item)) {
      throw `data.items[${i}] of order ${id} is not a JSON object`;
    }
    return JSON.stringify({
      ...rest,
      id: `${id}-${i}`,
      type: `${type}.item`,
      datacontenttype: "application/json",
      data: { ...item, orderId },
    });
  });
}
