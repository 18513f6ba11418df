//! The body, and the invariants it checks, is `sluice::fuzzing::ce_structured` (the stable corpus
//! test, `gateway/tests/fuzz_corpora.rs`, runs it too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice::fuzzing::ce_structured(data));
