// A Sluice function that maps an event: it adds `data.total` (the sum of
// `data.items[].price * qty`, when the event has items) and the extension
// attribute `enriched: "true"`.
//
// The contract is schemas/wit/function.wit: `handle` gets one CloudEvent in the
// JSON structured format and returns the events to pass on (here always one).
// componentize-js maps a thrown string to `err(message)`, which dead-letters
// the event with that message as the reason. A thrown `Error` object is not
// turned into `err`: it traps (the event is dead-lettered too, but the reason
// is the trap, not the message), so errors are thrown as strings here.

export function handle(text) {
  let event;
  try {
    event = JSON.parse(text);
  } catch (e) {
    throw `the event is not JSON: ${e.message}`;
  }
  const data = event.data;
  if (data === null || typeof data !== "object" || Array.isArray(data)) {
    throw `data of event ${event.id} is not a JSON object`;
  }
  if (Array.isArray(data.items)) {
    let total = 0;
    data.items.forEach((item, i) => {
      const price = Number(item?.price);
      const qty = Number(item?.qty ?? 1);
      if (!Number.isFinite(price) || !Number.isFinite(qty)) {
        throw `data.items[${i}] has no numeric price and qty`;
      }
      total += price * qty;
    });
    // Cents, so that 0.1 + 0.2 is 0.3.
    data.total = Math.round(total * 100) / 100;
  }
  event.enriched = "true";
  return [JSON.stringify(event)];
}
