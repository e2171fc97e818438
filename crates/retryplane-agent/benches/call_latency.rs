//! Per-call latency of `Endpoint::call` on 2 threads, with and without a third thread that
//! swaps the agent's policy set every 10 ms, and a check that no call sees a mix of two sets.
//!
//! Not a criterion bench (criterion reports means, not tails): a `main` that runs phases and
//! prints percentiles. Each phase runs [`CALLS`] calls on each of 2 threads started together,
//! each thread on its own current-thread runtime, and times every call with tokio's clock
//! (one clock read per call: a call's time is the time from the previous call's end, so the
//! loop's own cost is in every figure; the `bare` phase, timed the same way, shows that floor).
//! The call is the one of the `call` bench: `CallMeta::http("GET", "/v1/items/12345")` on the
//! middle endpoint of 1,000, answered `200` at once.
//!
//! Phases, in this order: `bare`, `retryplane`, `retryplane+swaps`, `retryplane` again,
//! `retryplane+swaps` again, so drift on a shared machine shows as a difference between the
//! repeats. During the swaps each call also checks what it saw: its first attempt's timeout
//! (the route's `per_try_timeout`) and its deadline must both be set A's or both set B's. A
//! last phase checks `max_attempts` the same way: one thread makes calls that fail every
//! attempt (503, 1 ms pauses) for 2 s while the sets are swapped, and each call's number of
//! attempts, timeouts and deadline must all come from one set.
//!
//! Columns: nearest-rank percentiles, the longest call and the mean in nanoseconds;
//! `>=100us` counts calls of 100 µs or more (a thread preempted by another process, or a call
//! that freed a replaced snapshot); `saw A` / `saw B` count calls that saw one set whole,
//! `torn` those that saw a mix, `failed` calls that did not return the 200.
//!
//! ```text
//! cargo bench -p retryplane-agent --bench call_latency
//! ```

#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

#[allow(
    dead_code,
    reason = "shared with the call bench, which uses less of it"
)]
mod support;

use std::hint::black_box;
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::Duration;

use retryplane_agent::{Cause, Endpoint, GiveUpCause};
use support::{
    CHECK, HOT, SwapStats, Swapper, Variant, agent, meta, runtime, unavailable, upstream,
};
use tokio::time::Instant;

/// Calls per thread per phase.
const CALLS: usize = 2_000_000;
/// How long the `max_attempts` check runs.
const CHECK_FOR: Duration = Duration::from_secs(2);

/// What one thread saw in one phase.
#[derive(Default)]
struct Seen {
    /// Each call's time in nanoseconds.
    nanos: Vec<u32>,
    a: u64,
    b: u64,
    torn: u64,
    failed: u64,
}

impl Seen {
    fn merge(&mut self, other: Seen) {
        self.nanos.extend(other.nanos);
        self.a += other.a;
        self.b += other.b;
        self.torn += other.torn;
        self.failed += other.failed;
    }
}

fn nanos(d: Duration) -> u32 {
    u32::try_from(d.as_nanos()).unwrap_or(u32::MAX)
}

/// [`CALLS`] calls on this thread: the bare call, or `Endpoint::call` on `ep`.
async fn calls(ep: Option<&Endpoint>) -> Seen {
    let mut seen = Seen {
        nanos: Vec::with_capacity(CALLS),
        ..Seen::default()
    };
    let mut prev = Instant::now();
    for _ in 0..CALLS {
        match ep {
            None => {
                let r = black_box(upstream().await);
                let now = Instant::now();
                seen.nanos.push(nanos(now.duration_since(prev)));
                prev = now;
                if r.is_err() {
                    seen.failed += 1;
                }
            }
            Some(ep) => {
                let mut first = None;
                let r = ep
                    .call(meta(), |info| {
                        first.get_or_insert((info.timeout, info.deadline));
                        upstream()
                    })
                    .await;
                let now = Instant::now();
                seen.nanos.push(nanos(now.duration_since(prev)));
                match (black_box(r), first) {
                    (Ok(_), Some((timeout, deadline))) => {
                        match Variant::of_hot(timeout, deadline.saturating_duration_since(prev)) {
                            Some(Variant::A) => seen.a += 1,
                            Some(Variant::B) => seen.b += 1,
                            None => seen.torn += 1,
                        }
                    }
                    _ => seen.failed += 1,
                }
                prev = now;
            }
        }
    }
    seen
}

/// One phase on 2 threads started together.
fn phase(ep: Option<&Endpoint>) -> Seen {
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let rt = runtime();
                    let ep = ep.cloned();
                    start.wait();
                    rt.block_on(calls(ep.as_ref()))
                })
            })
            .collect();
        let mut all = Seen::default();
        for t in threads {
            all.merge(t.join().expect("a bench thread does not panic"));
        }
        all
    })
}

/// The nearest-rank percentile `p` (0..=100) of sorted `v`.
fn pct(v: &[u32], p: f64) -> u32 {
    if v.is_empty() {
        return 0;
    }
    let rank = (p / 100.0 * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn print_header() {
    println!(
        "{:<18} {:>9} {:>6} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>8}  {:>8} {:>8} {:>5} {:>6}",
        "phase",
        "calls",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "p99.99",
        "max",
        "mean",
        ">=100us",
        "saw A",
        "saw B",
        "torn",
        "failed"
    );
}

fn print_row(name: &str, mut seen: Seen, swaps: Option<SwapStats>) -> bool {
    seen.nanos.sort_unstable();
    let v = &seen.nanos;
    let mean = v.iter().map(|&n| u64::from(n)).sum::<u64>() / (v.len().max(1) as u64);
    let slow = v.len() - v.partition_point(|&n| n < 100_000);
    println!(
        "{:<18} {:>9} {:>6} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>8}  {:>8} {:>8} {:>5} {:>6}",
        name,
        v.len(),
        pct(v, 50.0),
        pct(v, 90.0),
        pct(v, 99.0),
        pct(v, 99.9),
        pct(v, 99.99),
        v.last().copied().unwrap_or(0),
        mean,
        slow,
        seen.a,
        seen.b,
        seen.torn,
        seen.failed,
    );
    if let Some(s) = swaps {
        println!(
            "{:<18} {} swaps; Agent::set_policies took {:?} on average, {:?} at most",
            "", s.swaps, s.mean, s.max
        );
    }
    seen.torn == 0 && seen.failed == 0
}

/// What the `max_attempts` check found.
#[derive(Default, Debug)]
struct Checked {
    a: u64,
    b: u64,
    torn: u64,
}

/// Calls to [`CHECK`] that fail every attempt, for [`CHECK_FOR`], while `swapper` runs.
async fn check_attempts(ep: &Endpoint) -> Checked {
    let mut checked = Checked::default();
    let until = Instant::now() + CHECK_FOR;
    // Bounded by time, and by count in case the pauses were shorter than they should be.
    for _ in 0..100_000 {
        if Instant::now() >= until {
            break;
        }
        let before = Instant::now();
        let mut attempts = Vec::new();
        let r = ep
            .call(meta(), |info| {
                attempts.push((info.timeout, info.deadline));
                unavailable()
            })
            .await;
        let exhausted = matches!(
            r,
            Err(ref e) if e.cause == Cause::GaveUp(GiveUpCause::AttemptsExhausted)
        );
        let whole = [Variant::A, Variant::B].into_iter().find(|v| {
            let e = v.expect();
            let n = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
            exhausted
                && n == e.check_attempts
                && attempts.iter().all(|&(timeout, deadline)| {
                    let after = deadline.saturating_duration_since(before);
                    timeout == e.check_timeout
                        && after >= e.check_deadline
                        && after < e.check_deadline + Duration::from_secs(1)
                })
        });
        match whole {
            Some(Variant::A) => checked.a += 1,
            Some(Variant::B) => checked.b += 1,
            None => checked.torn += 1,
        }
    }
    checked
}

fn main() -> ExitCode {
    let agent = agent();
    let ep = agent.endpoint(HOT);
    let mut ok = true;
    println!(
        "per-call time in ns, {CALLS} calls on each of 2 threads per phase; swaps every {:?}",
        support::SWAP_EVERY
    );
    print_header();
    ok &= print_row("bare", phase(None), None);
    for _ in 0..2 {
        ok &= print_row("retryplane", phase(Some(&ep)), None);
        let swapper = Swapper::start(&agent);
        let seen = phase(Some(&ep));
        let stats = swapper.stop();
        ok &= seen.a > 0 && seen.b > 0;
        ok &= print_row("retryplane+swaps", seen, Some(stats));
    }

    // What it costs to free a replaced snapshot, which falls to whoever releases it last.
    // Held here as a call would hold it, over two swaps (the agent keeps the replaced one
    // until the next swap), so that this release is the last.
    let held = agent.policies();
    agent.set_policies(support::policy_set(Variant::B));
    agent.set_policies(support::policy_set(Variant::A));
    let t0 = Instant::now();
    drop(held);
    println!(
        "freeing a replaced snapshot of 1,000 endpoints took {:?} (Agent::set_policies frees \
         the one it replaced at the next swap, unless a call started before that is still \
         running)",
        t0.elapsed()
    );

    let check = agent.endpoint(CHECK);
    let swapper = Swapper::start(&agent);
    let checked = runtime().block_on(check_attempts(&check));
    let stats = swapper.stop();
    println!(
        "max_attempts check ({CHECK}, every attempt 503, {} swaps): {} calls whole on set A \
         (2 attempts), {} on set B (3 attempts), {} mixed",
        stats.swaps, checked.a, checked.b, checked.torn
    );
    ok &= checked.torn == 0 && checked.a > 0 && checked.b > 0;
    if ok {
        println!("no torn reads, no failed calls, both sets seen");
        ExitCode::SUCCESS
    } else {
        println!("FAILED: a torn read, a failed call, or a set never seen (see above)");
        ExitCode::FAILURE
    }
}
