//! The body is `sluice_functions::fuzzing::cesql_parse` (the stable corpus test runs it too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice_functions::fuzzing::cesql_parse(data));
