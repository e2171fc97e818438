//! Policy loading must never panic, hang or blow the stack, whatever the bytes: the same
//! property the proptests check, driven by coverage.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let loaded = retryplane_policy::load(data);
    assert_eq!(loaded.policies.is_some(), !loaded.has_errors());
});
