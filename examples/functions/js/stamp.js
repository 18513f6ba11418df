// Stamps each event with the time the gateway handled it (the extension `handledat`,
// RFC 3339) and a random trace id (`stampid`). Needs the `clocks` and `random` grants:
// build it with those WASI features left on (build.mjs does, for this one), and give the
// function `grants = ["clocks", "random"]`. Without the grants the event is dead-lettered:
// the clock import traps.
export function handle(text) {
  const event = JSON.parse(text);
  event.handledat = new Date().toISOString();
  // Math.random() gives 32 random bits here (its low bits are zero past that).
  event.stampid = Math.floor(Math.random() * 2 ** 32)
    .toString(16)
    .padStart(8, "0");
  return [JSON.stringify(event)];
}
