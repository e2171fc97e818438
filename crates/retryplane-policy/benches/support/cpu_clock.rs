//! The benches' CPU-time clock, one file for the policy crate's benches and the agent crate's
//! (which includes it by `#[path]`): a bench crate cannot depend on another's bench code.

use std::time::Duration;

/// Whether the benches time with the thread's CPU time instead of the wall clock:
/// `RETRYPLANE_BENCH_CPU_TIME=1`. On a shared machine, time-slicing by other processes then
/// does not count.
pub fn cpu_time_mode() -> bool {
    std::env::var_os("RETRYPLANE_BENCH_CPU_TIME").is_some_and(|v| v == "1")
}

/// This thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}
