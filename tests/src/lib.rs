//! The shared end-to-end test harness.
