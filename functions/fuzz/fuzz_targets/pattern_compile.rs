//! The body is `sluice_functions::fuzzing::pattern_compile` (the stable corpus test runs it too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice_functions::fuzzing::pattern_compile(data));
