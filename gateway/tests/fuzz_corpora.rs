//! A short fuzzing pass on the stable toolchain (part of `make test`): every fuzz target's
//! body (`sluice::fuzzing`, `sluice_functions::fuzzing`) over its committed corpus
//! (`gateway/fuzz/corpus/<target>`, `functions/fuzz/corpus/<target>`), then over a fixed
//! number of deterministic mutations of it. `make fuzz` runs the real fuzzer (nightly,
//! cargo-fuzz) for longer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Mutated inputs per target, on top of the corpus.
const MUTATIONS: usize = 2_000;
/// Largest mutated input (libFuzzer's default `-max_len` is 4096).
const MAX_LEN: usize = 4096;

/// Byte strings the mutator splices in: the syntax and edge values the parsers care about.
const TOKENS: &[&[u8]] = &[
    b"\"",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"\\udc00",
    b"%",
    b"%00",
    b"%FF",
    b"%C3%A9",
    b"%01",
    b"\x01",
    b"\x02",
    b"\x7f",
    b"\xc2\x85",
    b"\xff",
    b"\n",
    b"\r\n",
    b"\n\n",
    b": ",
    b",",
    b"{",
    b"}",
    b"[",
    b"]",
    b"null",
    b"true",
    b"1e400",
    b"-0",
    b"2147483648",
    b"\"data\":",
    b"\"data_base64\":",
    b"\"datacontenttype\":",
    b"application/json",
    b"Application/JSON",
    b"text/json",
    b"text/plain",
    b"+json",
    b";charset=utf-8",
    b"ce-",
    b"content-type: ",
    b"ce-specversion: 1.0",
    b"ce-datacontenttype: ",
    b"\"specversion\":\"1.0\"",
    b"$.data",
    b"${a}",
    b"'",
    b"AND",
    b"LIKE",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x01\x00",
];

/// A xorshift64* generator: the same inputs every run, without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four of: flip a byte, set an interesting byte, insert a token, delete a range,
/// duplicate a range, splice in part of another corpus entry.
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(6) {
            0 if !out.is_empty() => {
                let i = at.min(out.len() - 1);
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let i = at.min(out.len() - 1);
                out[i] = [0, 1, 0x7f, 0x80, 0xff, b'"', b'%', b'\\', b'\n', b'0'][rng.below(10)];
            }
            2 => {
                let token = TOKENS[rng.below(TOKENS.len())];
                out.splice(at..at, token.iter().copied());
            }
            3 if !out.is_empty() => {
                let end = (at + 1 + rng.below(16)).min(out.len());
                out.drain(at.min(end)..end);
            }
            4 if !out.is_empty() => {
                let end = (at + 1 + rng.below(32)).min(out.len());
                let piece = out[at.min(end)..end].to_vec();
                out.splice(at..at, piece);
            }
            _ => {
                let other = &corpus[rng.below(corpus.len())];
                let from = rng.below(other.len());
                let end = (from + 1 + rng.below(64)).min(other.len());
                out.splice(at..at, other[from..end].iter().copied());
            }
        }
    }
    out.truncate(MAX_LEN);
    out
}

fn read_corpus(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files
}

/// Runs `body` over the corpus and its mutations; a failing input is printed (escaped) and
/// written to `target/fuzz-failures/` before the test fails.
fn run(crate_dir: &str, target: &str, body: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(crate_dir)
        .join("fuzz/corpus")
        .join(target);
    let files = read_corpus(&dir);
    let corpus: Vec<Vec<u8>> = files.iter().map(|(_, b)| b.clone()).collect();
    let check = |input: &[u8], what: &str| {
        if catch_unwind(AssertUnwindSafe(|| body(input))).is_err() {
            let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-failures");
            let _ = std::fs::create_dir_all(&out);
            let file = out.join(format!("{target}-{}", what.replace(['/', ' '], "_")));
            let _ = std::fs::write(&file, input);
            panic!(
                "fuzz target {target} failed on {what} (saved as {}; reproduce with \
                 `cargo +nightly fuzz run {target} <file>` in {crate_dir}/fuzz): {:?}",
                file.display(),
                String::from_utf8_lossy(input)
            );
        }
    };
    for (path, bytes) in &files {
        check(bytes, &path.file_name().unwrap().to_string_lossy());
    }
    // One seed per target: the same mutations every run.
    let seed = target.bytes().fold(0x9e37_79b9_7f4a_7c15u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = Rng(seed | 1);
    for i in 0..MUTATIONS {
        let base = &corpus[rng.below(corpus.len())];
        let input = mutate(&mut rng, base, &corpus);
        check(&input, &format!("mutation {i}"));
    }
}

/// One test per fuzz target: the directory of its crate, and the target, which names both
/// its corpus and its function in that crate's `fuzzing` module.
macro_rules! fuzz_tests {
    ($($test:ident: $dir:literal, $krate:ident::$target:ident;)*) => {$(
        #[test]
        fn $test() {
            run($dir, stringify!($target), $krate::fuzzing::$target);
        }
    )*};
}

fuzz_tests! {
    fuzz_ce_structured: ".", sluice::ce_structured;
    fuzz_ce_batch: ".", sluice::ce_batch;
    fuzz_ce_binary: ".", sluice::ce_binary;
    fuzz_record_decode: ".", sluice::record_decode;
    fuzz_header_encode: ".", sluice::header_encode;
    fuzz_pattern_compile: "../functions", sluice_functions::pattern_compile;
    fuzz_cesql_parse: "../functions", sluice_functions::cesql_parse;
    fuzz_template: "../functions", sluice_functions::template;
}
