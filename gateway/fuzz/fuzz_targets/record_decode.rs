//! The body, and the invariants it checks, is `sluice::fuzzing::record_decode` (the stable corpus
//! test, `gateway/tests/fuzz_corpora.rs`, runs it too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice::fuzzing::record_decode(data));
