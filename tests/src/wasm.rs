//! WebAssembly components of the `sluice:function/transform` world for the tests, written
//! in the WebAssembly text format and assembled by the `wat` crate: no wasm32 toolchain is
//! needed. Each is a small core module (a bump allocator reset after each call by the
//! `post-return` function, `handle` lowering the
//! contract's `result<list<string>, string>` by the canonical ABI) lifted into a
//! component exporting `handle`.

/// What a test function does with the event it is given.
#[derive(Debug, Clone)]
pub enum Behaviour {
    /// One event per prefix, in order: the prefix followed by the input event without its
    /// opening `{` (so `{"part":"1",` adds the extension `part` to the event). No prefix:
    /// the event is dropped.
    Prefixes(Vec<String>),
    /// Returns these texts as the events (for output the gateway must refuse).
    Constant(Vec<String>),
    /// Returns `err(message)`.
    Error(String),
    /// Executes `unreachable`.
    Trap,
    /// Loops forever.
    Loop,
    /// Grows its memory until refused, then traps.
    MemoryBomb,
    /// Maps each event, adding the extension `first`: `yes` on the instance's first call,
    /// `no` on later ones (shows whether an instance served several events).
    Remembers,
}

impl Behaviour {
    /// Maps each event: adds the extension `wasmversion` with `version`.
    pub fn map(version: &str) -> Behaviour {
        Behaviour::Prefixes(vec![format!("{{\"wasmversion\":\"{version}\",")])
    }

    /// Fans each event out into `n` events carrying the extension `part` = 1..=n.
    pub fn fan_out(n: usize) -> Behaviour {
        Behaviour::Prefixes((1..=n).map(|i| format!("{{\"part\":\"{i}\",")).collect())
    }
}

/// Where constant strings go in the module's memory.
const DATA: usize = 1024;
/// Where the `handle` result (discriminant, pointer, length) is written.
const RESULT: usize = 16;

fn escape(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("\\{b:02x}")).collect()
}

/// The code of `handle` returning one event per text: the text followed by the input
/// event without its opening `{` when `prefixed`, the text alone otherwise.
fn returns(
    texts: &[String],
    prefixed: bool,
    place: &mut impl FnMut(&str) -> (usize, usize),
) -> String {
    let n = texts.len();
    let mut code = format!(
        "(local.set $arr (call $realloc (i32.const 0) (i32.const 0) (i32.const 4) (i32.const {})))\n",
        8 * n
    );
    for (k, text) in texts.iter().enumerate() {
        let (at, len) = place(text);
        let size = if prefixed {
            format!("(i32.add (i32.const {len}) (i32.sub (local.get $len) (i32.const 1)))")
        } else {
            format!("(i32.const {len})")
        };
        code.push_str(&format!(
            "(local.set $o (call $realloc (i32.const 0) (i32.const 0) (i32.const 1) {size}))\n\
             (memory.copy (local.get $o) (i32.const {at}) (i32.const {len}))\n"
        ));
        if prefixed {
            code.push_str(&format!(
                "(memory.copy (i32.add (local.get $o) (i32.const {len})) (i32.add (local.get $ptr) (i32.const 1)) (i32.sub (local.get $len) (i32.const 1)))\n"
            ));
        }
        code.push_str(&format!(
            "(i32.store (i32.add (local.get $arr) (i32.const {})) (local.get $o))\n\
             (i32.store (i32.add (local.get $arr) (i32.const {})) {size})\n",
            8 * k,
            8 * k + 4
        ));
    }
    code.push_str(&format!(
        "(i32.store8 (i32.const {RESULT}) (i32.const 0))\n\
         (i32.store (i32.const {}) (local.get $arr))\n\
         (i32.store (i32.const {}) (i32.const {n}))\n\
         (i32.const {RESULT})",
        RESULT + 4,
        RESULT + 8
    ));
    code
}

/// The component's bytes.
pub fn component(behaviour: &Behaviour) -> Vec<u8> {
    let mut data = String::new();
    let mut offset = DATA;
    let mut place = |text: &str| -> (usize, usize) {
        let at = offset;
        data.push_str(&format!(
            "    (data (i32.const {at}) \"{}\")\n",
            escape(text.as_bytes())
        ));
        offset += text.len();
        (at, text.len())
    };
    let body = match behaviour {
        Behaviour::Prefixes(prefixes) => returns(prefixes, true, &mut place),
        Behaviour::Constant(texts) => returns(texts, false, &mut place),
        Behaviour::Remembers => {
            let no = returns(&["{\"first\":\"no\",".to_string()], true, &mut place);
            let yes = returns(&["{\"first\":\"yes\",".to_string()], true, &mut place);
            format!(
                "(if (result i32) (global.get $called)\n(then {no})\n(else (global.set $called (i32.const 1))\n{yes}))"
            )
        }
        Behaviour::Error(message) => {
            let (at, len) = place(message);
            format!(
                "(i32.store8 (i32.const {RESULT}) (i32.const 1))\n\
                 (i32.store (i32.const {}) (i32.const {at}))\n\
                 (i32.store (i32.const {}) (i32.const {len}))\n\
                 (i32.const {RESULT})",
                RESULT + 4,
                RESULT + 8
            )
        }
        Behaviour::Trap => "unreachable".to_string(),
        Behaviour::Loop => "(loop $forever (br $forever))\nunreachable".to_string(),
        Behaviour::MemoryBomb => "(loop $more (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))\nunreachable".to_string(),
    };
    let text = format!(
        r#"(component
  (core module $m
    (memory (export "memory") 2)
    (global $bump (mut i32) (i32.const 65536))
    (global $called (mut i32) (i32.const 0))
{data}
    (func $realloc (export "realloc") (param $old i32) (param $old_size i32) (param $align i32) (param $size i32) (result i32)
      (local $p i32)
      (local.set $p (i32.and
        (i32.add (global.get $bump) (i32.sub (local.get $align) (i32.const 1)))
        (i32.xor (i32.sub (local.get $align) (i32.const 1)) (i32.const -1))))
      (block $ok
        (loop $grow
          (br_if $ok (i32.le_u (i32.add (local.get $p) (local.get $size))
                               (i32.mul (memory.size) (i32.const 65536))))
          (if (i32.eq (memory.grow (i32.const 1)) (i32.const -1)) (then unreachable))
          (br $grow)))
      (global.set $bump (i32.add (local.get $p) (local.get $size)))
      (if (local.get $old_size)
        (then (memory.copy (local.get $p) (local.get $old) (local.get $old_size))))
      (local.get $p))
    (func (export "handle") (param $ptr i32) (param $len i32) (result i32)
      (local $arr i32) (local $o i32)
      {body})
    ;; After the host has read the results: what the call allocated is free again (an
    ;; instance serves many events; its memory must not grow with each).
    (func (export "post") (param i32)
      (global.set $bump (i32.const 65536)))
  )
  (core instance $i (instantiate $m))
  (func (export "handle") (param "event" string) (result (result (list string) (error string)))
    (canon lift (core func $i "handle") (memory (core memory $i "memory")) (realloc (core func $i "realloc"))
      (post-return (core func $i "post"))))
)"#
    );
    match wat::parse_str(&text) {
        Ok(bytes) => bytes,
        Err(e) => panic!("test component does not assemble: {e}\n{text}"),
    }
}

/// A component whose `handle` has another type than the contract's.
pub fn wrong_signature() -> Vec<u8> {
    let text = r#"(component
  (core module $m (func (export "handle") (param i32) (result i32) (local.get 0)))
  (core instance $i (instantiate $m))
  (func (export "handle") (param "x" u32) (result u32) (canon lift (core func $i "handle")))
)"#;
    wat::parse_str(text).unwrap_or_else(|e| panic!("{e}"))
}

/// A component that imports a WASI interface (the wall clock) and calls it: linked to a
/// stub that traps, since nothing is granted.
pub fn reads_the_clock() -> Vec<u8> {
    let text = r#"(component
  (type $datetime (record (field "seconds" u64) (field "nanoseconds" u32)))
  (import "wasi:clocks/wall-clock@0.2.0" (instance $clock
    (export "datetime" (type $dt (eq $datetime)))
    (export "now" (func (result $dt)))))
  (alias export $clock "now" (func $now))
  (core module $mem (memory (export "memory") 1))
  (core instance $mi (instantiate $mem))
  (core func $now_lowered (canon lower (func $now) (memory (core memory $mi "memory"))))
  (core module $m
    (import "host" "now" (func $now (param i32)))
    (import "host" "memory" (memory 1))
    (func (export "handle") (param i32 i32) (result i32)
      (call $now (i32.const 64))
      unreachable)
    (func (export "realloc") (param i32 i32 i32 i32) (result i32) (i32.const 1024)))
  (core instance $i (instantiate $m (with "host" (instance
    (export "now" (func $now_lowered))
    (export "memory" (memory $mi "memory"))))))
  (func (export "handle") (param "event" string) (result (result (list string) (error string)))
    (canon lift (core func $i "handle") (memory (core memory $mi "memory")) (realloc (core func $i "realloc"))))
)"#;
    wat::parse_str(text).unwrap_or_else(|e| panic!("{e}"))
}

/// What of the host a test function reads (and fails without).
#[derive(Debug, Clone, Copy)]
pub enum HostUse {
    /// The wall clock: returns `event` when it reads a time after 2023, traps otherwise.
    Clock,
    /// Randomness: returns `event` when `get-random-u64` gives a non-zero number.
    Random,
    /// The environment: returns the value of its first variable as the event.
    Env,
}

/// A component importing the wall clock, randomness and the environment (WASI 0.2.3
/// names) and calling the one `what` names; without the grant the stub traps.
pub fn uses_host(what: HostUse, event: &str) -> Vec<u8> {
    let body = match what {
        HostUse::Clock => {
            "(call $now (i32.const 64))
      (if (i64.lt_u (i64.load (i32.const 64)) (i64.const 1700000000)) (then unreachable))
      (i32.store (i32.const 128) (i32.const 1024))
      (i32.store (i32.const 132) (i32.const LEN))"
        }
        HostUse::Random => {
            "(if (i64.eqz (call $rand)) (then unreachable))
      (i32.store (i32.const 128) (i32.const 1024))
      (i32.store (i32.const 132) (i32.const LEN))"
        }
        HostUse::Env => {
            "(call $env (i32.const 64))
      (if (i32.eqz (i32.load (i32.const 68))) (then unreachable))
      (i32.store (i32.const 128) (i32.load offset=8 (i32.load (i32.const 64))))
      (i32.store (i32.const 132) (i32.load offset=12 (i32.load (i32.const 64))))"
        }
    }
    .replace("LEN", &event.len().to_string());
    let text = format!(
        r#"(component
  (type $datetime (record (field "seconds" u64) (field "nanoseconds" u32)))
  (import "wasi:clocks/wall-clock@0.2.3" (instance $clock
    (export "datetime" (type $dt (eq $datetime)))
    (export "now" (func (result $dt)))))
  (import "wasi:random/random@0.2.3" (instance $random
    (export "get-random-u64" (func (result u64)))))
  (import "wasi:cli/environment@0.2.3" (instance $environment
    (export "get-environment" (func (result (list (tuple string string)))))))
  (alias export $clock "now" (func $now))
  (alias export $random "get-random-u64" (func $rand))
  (alias export $environment "get-environment" (func $getenv))
  (core module $mem
    (memory (export "memory") 1)
    (global $bump (mut i32) (i32.const 4096))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $p i32)
      (if (i32.gt_u (i32.add (global.get $bump) (local.get 3)) (i32.const 60000))
        (then (global.set $bump (i32.const 4096))))
      (local.set $p (global.get $bump))
      (global.set $bump (i32.and (i32.add (i32.add (global.get $bump) (local.get 3)) (i32.const 7)) (i32.const -8)))
      (local.get $p)))
  (core instance $mi (instantiate $mem))
  (core func $now_lowered (canon lower (func $now) (memory (core memory $mi "memory"))))
  (core func $rand_lowered (canon lower (func $rand)))
  (core func $env_lowered (canon lower (func $getenv) (memory (core memory $mi "memory")) (realloc (core func $mi "realloc"))))
  (core module $m
    (import "host" "now" (func $now (param i32)))
    (import "host" "rand" (func $rand (result i64)))
    (import "host" "env" (func $env (param i32)))
    (import "host" "memory" (memory 1))
    (data (i32.const 1024) "{event}")
    (func (export "handle") (param i32 i32) (result i32)
      {body}
      (i32.store8 (i32.const 16) (i32.const 0))
      (i32.store (i32.const 20) (i32.const 128))
      (i32.store (i32.const 24) (i32.const 1))
      (i32.const 16)))
  (core instance $i (instantiate $m (with "host" (instance
    (export "now" (func $now_lowered))
    (export "rand" (func $rand_lowered))
    (export "env" (func $env_lowered))
    (export "memory" (memory $mi "memory"))))))
  (func (export "handle") (param "event" string) (result (result (list string) (error string)))
    (canon lift (core func $i "handle") (memory (core memory $mi "memory")) (realloc (core func $mi "realloc"))))
)"#,
        event = escape(event.as_bytes())
    );
    match wat::parse_str(&text) {
        Ok(bytes) => bytes,
        Err(e) => panic!("test component does not assemble: {e}\n{text}"),
    }
}
