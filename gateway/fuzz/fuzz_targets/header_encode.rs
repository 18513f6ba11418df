//! The body, and the invariants it checks, is `sluice::fuzzing::header_encode` (the stable corpus
//! test, `gateway/tests/fuzz_corpora.rs`, runs it too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice::fuzzing::header_encode(data));
