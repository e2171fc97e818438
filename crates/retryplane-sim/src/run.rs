//! One variant's run: the discrete-event loop around the real engine.
//!
//! Virtual time is a `u64` count of nanoseconds since the start of the run. The queue is a
//! binary heap of `(time, sequence, call, kind)`: events at the same nanosecond run in the order
//! they were scheduled, so a run is a pure function of its inputs. Arrivals do not go through
//! the heap: each client's arrival times (exponential gaps, Poisson at `rate`, from the
//! client's own RNG) are generated one second of virtual time at a time and sorted by
//! `(time, client)`, and the loop takes whichever comes first, the next arrival or the heap's
//! next event (the arrival on a tie). The heap then only holds calls in flight or in a pause.
//! Events:
//!
//! - **arrival** of a client's next logical call: a [`RetryCall`] is created at that instant on
//!   the client's own [`EndpointState`] (budget and breaker) and its first attempt starts;
//! - **response** to an attempt: the upstream's answer (decided when the attempt was sent) is
//!   reported to [`RetryCall::on_outcome`] with the client's own RNG, and the engine's decision
//!   is carried out: done, give up, or resume after the pause;
//! - **resume** after a pause: the next attempt starts (a zero pause starts it at once).
//!
//! The engine takes `tokio::time::Instant`s; each virtual time `t` is passed as
//! `origin + t`. The engine reads no clock, so the run never waits and its results do not
//! depend on `origin`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retryplane_policy::RetryPolicy;
use retryplane_policy::engine::{
    CallInfo, Decision, EndpointState, GiveUpCause, Outcome, RetryCall,
};
use retryplane_policy::rng::{Rng, SeededRng};
use tokio::time::Instant;

use crate::config::{Config, MAX_IN_FLIGHT};
use crate::latency::Latencies;
use crate::upstream::{Answer, Upstream, nanos};

const RESPONSE: u8 = 1;
const RESUME: u8 = 2;
const SECOND: u64 = 1_000_000_000;

/// What one variant's run recorded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// Attempts sent to the upstream, per second of virtual time.
    pub attempts: Vec<u64>,
    /// Logical calls started, per second.
    pub started: Vec<u64>,
    /// Logical calls that ended in success, per second of their start.
    pub succeeded: Vec<u64>,
    /// How long each logical call took, start to result.
    pub latencies: Latencies,
    /// Failed logical calls by cause, in [`GiveUpCause::ALL`] order.
    pub give_ups: [u64; 6],
}

/// The index of `cause` in [`GiveUpCause::ALL`].
pub fn cause_index(cause: GiveUpCause) -> usize {
    GiveUpCause::ALL
        .iter()
        .position(|c| *c == cause)
        .unwrap_or(0)
}

/// Adds one to `v[i]`, growing `v` as needed.
fn bump(v: &mut Vec<u64>, i: usize) {
    if v.len() <= i {
        v.resize(i + 1, 0);
    }
    v[i] += 1;
}

fn second(t: u64) -> usize {
    usize::try_from(t / SECOND).unwrap_or(usize::MAX)
}

/// SplitMix64: independent seeds for every client and stream from one seed.
pub(crate) fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut z = seed
        .wrapping_add(a.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(b.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The upstream's answer as the client sees it.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Answer(Answer),
    Timeout,
}

/// A logical call in progress.
struct Live<'a> {
    call: RetryCall<'a>,
    client: u32,
    started: u64,
    reply: Reply,
}

/// The state of one run.
struct Sim<'a> {
    policy: &'a RetryPolicy,
    states: &'a [EndpointState],
    info: CallInfo,
    origin: Instant,
    arrivals: Arrivals,
    jitter: Vec<SeededRng>,
    upstream: Upstream,
    queue: BinaryHeap<Reverse<(u64, u64, u32, u8)>>,
    seq: u64,
    calls: Vec<Option<Live<'a>>>,
    free: Vec<u32>,
    trace: Trace,
    /// Where the virtual time of the arrivals generated so far has reached, in nanoseconds
    /// (see [`run_watched`]).
    reached: &'a AtomicU64,
}

/// A run stopped because it held `limit` calls in flight (or paused) at once: each takes
/// memory until it ends, and a policy whose pauses and deadline keep calls going while new
/// ones arrive can hold most of a long run's calls at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InFlight {
    /// The calls in flight when it stopped.
    pub limit: usize,
    /// When, in seconds of virtual time.
    pub at_s: f64,
}

/// Runs `policy` on `config`'s fleet and upstream, holding at most [`MAX_IN_FLIGHT`] calls in
/// flight at once. Every random stream depends only on the seed (and the client): every
/// variant sees the same calls arrive, and two variants that behave alike (a budget that
/// never refuses) get the very same figures.
pub fn run(policy: &RetryPolicy, config: &Config, origin: Instant) -> Result<Trace, InFlight> {
    run_watched(policy, config, origin, MAX_IN_FLIGHT, &AtomicU64::new(0))
}

/// [`run`] with at most `limit` calls in flight at once, storing in `reached`, a virtual second
/// at a time, how far into the run (in nanoseconds of virtual time, up to the config's
/// `duration`) the calls that have started reach: a long run's progress, for whoever watches
/// it from another thread. The calls still in flight at `duration` end after it.
pub fn run_watched(
    policy: &RetryPolicy,
    config: &Config,
    origin: Instant,
    limit: usize,
    reached: &AtomicU64,
) -> Result<Trace, InFlight> {
    let clients = config.clients as usize;
    let states: Vec<EndpointState> = (0..clients)
        .map(|_| EndpointState::new(policy, origin))
        .collect();
    let rngs = |kind: u64| -> Vec<SeededRng> {
        (0..clients as u64)
            .map(|c| SeededRng::with_seed(mix(config.seed, c, kind)))
            .collect()
    };
    let mut sim = Sim {
        policy,
        states: &states,
        info: CallInfo::http(policy, "GET", false),
        origin,
        arrivals: Arrivals::new(rngs(1), 1e9 / config.rate, nanos(config.duration)),
        jitter: rngs(2),
        upstream: Upstream::new(config, SeededRng::with_seed(mix(config.seed, u64::MAX, 3))),
        queue: BinaryHeap::with_capacity(1024),
        seq: 0,
        calls: Vec::new(),
        free: Vec::new(),
        trace: Trace::default(),
        reached,
    };
    sim.run(limit)?;
    reached.store(nanos(config.duration), Ordering::Relaxed);
    Ok(sim.trace)
}

/// Every client's arrivals, generated a second of virtual time at a time, in time order.
struct Arrivals {
    rngs: Vec<SeededRng>,
    /// Each client's next arrival not yet in `batch`.
    next: Vec<u64>,
    mean_gap: f64,
    end: u64,
    /// Arrivals before `horizon`, sorted by `(time, client)`; `pos` is the next one.
    batch: Vec<(u64, u32)>,
    pos: usize,
    horizon: u64,
    /// The virtual time past which the next arrival is stored as the run's progress.
    reported: u64,
}

impl Arrivals {
    fn new(mut rngs: Vec<SeededRng>, mean_gap: f64, end: u64) -> Self {
        let next = rngs.iter_mut().map(|r| gap(r, mean_gap)).collect();
        Self {
            rngs,
            next,
            mean_gap,
            end,
            batch: Vec::new(),
            pos: 0,
            horizon: 0,
            reported: 0,
        }
    }

    /// The next arrival, `None` once every arrival before `end` has been taken.
    fn peek(&mut self) -> Option<(u64, u32)> {
        while self.pos == self.batch.len() {
            if self.horizon >= self.end {
                return None;
            }
            let upto = self.horizon.saturating_add(SECOND).min(self.end);
            self.batch.clear();
            self.pos = 0;
            for (client, (next, rng)) in self.next.iter_mut().zip(&mut self.rngs).enumerate() {
                while *next < upto {
                    self.batch.push((*next, client as u32));
                    *next = next.saturating_add(gap(rng, self.mean_gap));
                }
            }
            self.batch.sort_unstable();
            self.horizon = upto;
        }
        self.batch.get(self.pos).copied()
    }
}

/// An exponential gap of mean `mean` nanoseconds, at least 1 ns.
fn gap(rng: &mut SeededRng, mean: f64) -> u64 {
    // A uniform value in (0, 1], so the logarithm is finite.
    let u = ((rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
    ((-u.ln() * mean) as u64).max(1)
}

impl<'a> Sim<'a> {
    fn push(&mut self, at: u64, id: u32, kind: u8) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, id, kind)));
    }

    fn at(&self, t: u64) -> Instant {
        self.origin + Duration::from_nanos(t)
    }

    fn run(&mut self, limit: usize) -> Result<(), InFlight> {
        loop {
            let event = self.queue.peek().map(|Reverse((t, ..))| *t);
            match (self.arrivals.peek(), event) {
                (Some((t, client)), e) if e.is_none_or(|e| t <= e) => {
                    if t >= self.arrivals.reported {
                        // Once a virtual second: a store no reader waits on.
                        self.reached.store(t, Ordering::Relaxed);
                        self.arrivals.reported = t.saturating_add(SECOND);
                    }
                    if self.calls.len() - self.free.len() >= limit {
                        return Err(InFlight {
                            limit,
                            at_s: t as f64 / SECOND as f64,
                        });
                    }
                    self.arrivals.pos += 1;
                    self.arrive(client, t);
                }
                (_, Some(_)) => {
                    if let Some(Reverse((t, _, id, kind))) = self.queue.pop() {
                        match kind {
                            RESPONSE => self.respond(id, t),
                            _ => self.attempt(id, t),
                        }
                    }
                }
                (_, None) => return Ok(()),
            }
        }
    }

    fn arrive(&mut self, client: u32, t: u64) {
        bump(&mut self.trace.started, second(t));
        let call = RetryCall::new(
            self.policy,
            &self.states[client as usize],
            self.info,
            self.at(t),
        );
        let live = Live {
            call,
            client,
            started: t,
            reply: Reply::Timeout,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.calls[id as usize] = Some(live);
                id
            }
            None => {
                self.calls.push(Some(live));
                (self.calls.len() - 1) as u32
            }
        };
        self.attempt(id, t);
    }

    fn attempt(&mut self, id: u32, t: u64) {
        let now = self.at(t);
        let Some(live) = self.calls[id as usize].as_mut() else {
            return;
        };
        match live.call.start_attempt(now) {
            Err(cause) => self.finish(id, t, Some(cause)),
            Ok(attempt) => {
                bump(&mut self.trace.attempts, second(t));
                let (answer, delay) = self.upstream.request(t);
                let timeout = nanos(attempt.timeout);
                let (reply, delay) = if delay >= timeout {
                    (Reply::Timeout, timeout)
                } else {
                    (Reply::Answer(answer), delay)
                };
                live.reply = reply;
                self.push(t.saturating_add(delay), id, RESPONSE);
            }
        }
    }

    fn respond(&mut self, id: u32, t: u64) {
        let now = self.at(t);
        let Some(live) = self.calls[id as usize].as_mut() else {
            return;
        };
        let outcome = match live.reply {
            Reply::Answer(Answer::Ok) => Outcome::Http {
                status: 200,
                retry_after: None,
            },
            Reply::Answer(Answer::Unavailable) => Outcome::Http {
                status: 503,
                retry_after: None,
            },
            Reply::Answer(Answer::Throttled(hint)) => Outcome::Http {
                status: 429,
                retry_after: Some(Ok(Duration::from_nanos(hint))),
            },
            Reply::Timeout => Outcome::Transport(retryplane_policy::ErrorClass::Timeout),
        };
        let rng = &mut self.jitter[live.client as usize];
        match live.call.on_outcome(outcome, now, rng) {
            Decision::Return => self.finish(id, t, None),
            Decision::GiveUp(cause) => self.finish(id, t, Some(cause)),
            Decision::Retry { pause, .. } if pause.is_zero() => self.attempt(id, t),
            Decision::Retry { pause, .. } => {
                self.push(t.saturating_add(nanos(pause)), id, RESUME);
            }
        }
    }

    /// Ends call `id` at `t`: a success when `cause` is `None`.
    fn finish(&mut self, id: u32, t: u64, cause: Option<GiveUpCause>) {
        let Some(live) = self.calls[id as usize].take() else {
            return;
        };
        self.free.push(id);
        self.trace.latencies.record(t - live.started);
        match cause {
            None => bump(&mut self.trace.succeeded, second(live.started)),
            Some(cause) => self.trace.give_ups[cause_index(cause)] += 1,
        }
    }
}
