//! What both agent benches share: the two 1,000-endpoint policy sets, the upstream call, the
//! runtime and the thread that swaps the sets.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, PolicySet};
use tokio::time::Instant;

#[path = "../../../retryplane-policy/benches/support/cpu_clock.rs"]
pub mod cpu_clock;

/// Endpoints in each set: `svc-0000` … `svc-0999`.
pub const ENDPOINTS: usize = 1000;
/// The endpoint every call goes to: the one in the middle (two routes, the call matches the
/// second).
pub const HOT: &str = "svc-0500";
/// The endpoint of the `max_attempts` check: every attempt fails, pauses are 1 ms, and neither
/// budget nor breaker get in the way.
pub const CHECK: &str = "svc-0501";
/// The request of every call: `GET`, matched by the second route of [`HOT`].
pub const METHOD: &str = "GET";
/// See [`METHOD`].
pub const PATH: &str = "/v1/items/12345";
/// How often the swapper replaces the agent's policy set.
pub const SWAP_EVERY: Duration = Duration::from_millis(10);

/// One of the two policy sets the swapper alternates. Every field a call can see differs
/// between them, so a call that mixed the two would show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Set A.
    A,
    /// Set B.
    B,
}

/// What a call sees under one [`Variant`].
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// [`HOT`]'s route: `per_try_timeout`, the first attempt's timeout.
    pub hot_timeout: Duration,
    /// [`HOT`]'s `deadline`.
    pub hot_deadline: Duration,
    /// [`CHECK`]'s `max_attempts`.
    pub check_attempts: u32,
    /// [`CHECK`]'s `per_try_timeout`.
    pub check_timeout: Duration,
    /// [`CHECK`]'s `deadline`.
    pub check_deadline: Duration,
}

impl Variant {
    /// The values of this set.
    pub fn expect(self) -> Expect {
        match self {
            Variant::A => Expect {
                hot_timeout: Duration::from_millis(500),
                hot_deadline: Duration::from_secs(10),
                check_attempts: 2,
                check_timeout: Duration::from_millis(400),
                check_deadline: Duration::from_secs(4),
            },
            Variant::B => Expect {
                hot_timeout: Duration::from_millis(700),
                hot_deadline: Duration::from_secs(12),
                check_attempts: 3,
                check_timeout: Duration::from_millis(600),
                check_deadline: Duration::from_secs(6),
            },
        }
    }

    /// Which set a hot call saw, from its first attempt's timeout and its deadline less the
    /// instant just before the call (`deadline_after`): `None` when they do not belong to one
    /// set (a torn read).
    pub fn of_hot(timeout: Duration, deadline_after: Duration) -> Option<Variant> {
        [Variant::A, Variant::B].into_iter().find(|v| {
            let e = v.expect();
            // The call starts after the instant it is measured from, by far less than a
            // second: the two deadlines are 2 s apart.
            timeout == e.hot_timeout
                && deadline_after >= e.hot_deadline
                && deadline_after < e.hot_deadline + Duration::from_secs(1)
        })
    }

    /// The other set.
    pub fn other(self) -> Variant {
        match self {
            Variant::A => Variant::B,
            Variant::B => Variant::A,
        }
    }
}

const ROUTES: &str = "    routes:
      - match: {method: POST, path_prefix: /v1/orders}
        max_attempts: 2
";

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The policy file of `variant`: 1,000 endpoints, most with defaults only or a field or two,
/// every 50th with routes, as in the policy crate's engine bench.
pub fn policy_yaml(variant: Variant) -> String {
    let e = variant.expect();
    let (defaults_attempts, hot_attempts) = match variant {
        Variant::A => (3, 4),
        Variant::B => (4, 3),
    };
    let mut y = String::with_capacity(128 * 1024);
    y.push_str(&format!(
        "version: 1\ndefaults:\n  max_attempts: {defaults_attempts}\n  deadline: 15s\n  \
         per_try_timeout: 2s\nendpoints:\n"
    ));
    for i in 0..ENDPOINTS {
        let name = format!("svc-{i:04}");
        if name == HOT {
            y.push_str(&format!(
                "  {name}:\n    max_attempts: {hot_attempts}\n    deadline: {}ms\n{ROUTES}      \
                 - match: {{method: GET, path_prefix: /v1/items}}\n        per_try_timeout: {}ms\n",
                ms(e.hot_deadline),
                ms(e.hot_timeout),
            ));
        } else if name == CHECK {
            y.push_str(&format!(
                "  {name}:\n    max_attempts: {}\n    deadline: {}ms\n    per_try_timeout: {}ms\n    \
                 backoff: {{base: 1ms, max: 1ms, jitter: none}}\n    budget: {{enabled: false}}\n    \
                 circuit_breaker: {{enabled: false}}\n",
                e.check_attempts,
                ms(e.check_deadline),
                ms(e.check_timeout),
            ));
        } else if i % 50 == 0 {
            y.push_str(&format!(
                "  {name}:\n    deadline: 5s\n{ROUTES}      \
                 - match: {{method: GET, path_prefix: /v1/items}}\n        per_try_timeout: 500ms\n"
            ));
        } else if i % 3 == 0 {
            y.push_str(&format!(
                "  {name}: {{max_attempts: 2, backoff: {{base: 50ms}}}}\n"
            ));
        } else {
            y.push_str(&format!("  {name}: {{}}\n"));
        }
    }
    y
}

/// The compiled set of `variant`.
pub fn policy_set(variant: Variant) -> PolicySet {
    let loaded = retryplane_policy::load(policy_yaml(variant).as_bytes());
    let set = loaded
        .policies
        .expect("the generated 1,000-endpoint file is valid");
    assert_eq!(set.len(), ENDPOINTS);
    set
}

/// A static agent on set A with a fixed RNG seed.
pub fn agent() -> Agent {
    Agent::from_policies_seeded(policy_set(Variant::A), 7)
}

/// The upstream call every variant makes: an HTTP client's answer, `200 OK` with no body.
pub async fn upstream() -> Result<http::Response<()>, std::io::Error> {
    Ok(http::Response::new(()))
}

/// The same answer after one `Pending`: the upstream waits once (it yields to the runtime), as
/// every call that goes over a network does, so the per-try timer is armed.
pub async fn upstream_waiting_once() -> Result<http::Response<()>, std::io::Error> {
    tokio::task::yield_now().await;
    Ok(http::Response::new(()))
}

/// An upstream that answers `503`.
pub async fn unavailable() -> Result<http::Response<()>, std::io::Error> {
    let mut r = http::Response::new(());
    *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
    Ok(r)
}

/// What a user writes for each call: the method and the path of the request.
pub fn meta() -> CallMeta<'static> {
    CallMeta::http(METHOD, PATH)
}

/// A current-thread runtime with the timer on (`Endpoint::call` needs one for its per-try
/// timeout).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime")
}

/// Times a stretch of this thread's work by the wall clock or, in
/// [`cpu_clock::cpu_time_mode`], by its CPU time.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch {
    wall: Instant,
    cpu: Option<Duration>,
}

impl Stopwatch {
    /// Starts timing now.
    pub fn start(cpu: bool) -> Stopwatch {
        Stopwatch {
            cpu: cpu.then(cpu_clock::thread_cpu_time),
            wall: Instant::now(),
        }
    }

    /// The time since [`Stopwatch::start`].
    pub fn elapsed(&self) -> Duration {
        match self.cpu {
            Some(c0) => cpu_clock::thread_cpu_time().saturating_sub(c0),
            None => self.wall.elapsed(),
        }
    }
}

/// A thread that replaces the agent's policies every [`SWAP_EVERY`] with
/// [`Agent::set_policies`], alternating sets B and A (the agent starts on A), until stopped.
pub struct Swapper {
    stop: Arc<AtomicBool>,
    swaps: Arc<AtomicU64>,
    swap_nanos: Arc<AtomicU64>,
    max_swap_nanos: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

/// What a [`Swapper`] did.
#[derive(Clone, Copy, Debug)]
pub struct SwapStats {
    /// Swaps made.
    pub swaps: u64,
    /// Mean time of one `set_policies` call (hash, snapshot build, store).
    pub mean: Duration,
    /// The longest one.
    pub max: Duration,
}

impl Swapper {
    /// Starts swapping `agent`'s policies.
    pub fn start(agent: &Agent) -> Swapper {
        let (a, b) = (policy_set(Variant::A), policy_set(Variant::B));
        let stop = Arc::new(AtomicBool::new(false));
        let swaps = Arc::new(AtomicU64::new(0));
        let swap_nanos = Arc::new(AtomicU64::new(0));
        let max_swap_nanos = Arc::new(AtomicU64::new(0));
        let thread = std::thread::spawn({
            let (agent, stop, swaps, swap_nanos, max_swap_nanos) = (
                agent.clone(),
                stop.clone(),
                swaps.clone(),
                swap_nanos.clone(),
                max_swap_nanos.clone(),
            );
            move || {
                runtime().block_on(async move {
                    let mut tick = tokio::time::interval(SWAP_EVERY);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    tick.tick().await;
                    let mut next = Variant::B;
                    while !stop.load(Relaxed) {
                        tick.tick().await;
                        let set = match next {
                            Variant::A => a.clone(),
                            Variant::B => b.clone(),
                        };
                        let t0 = Instant::now();
                        agent.set_policies(set);
                        let took = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        swap_nanos.fetch_add(took, Relaxed);
                        max_swap_nanos.fetch_max(took, Relaxed);
                        swaps.fetch_add(1, Relaxed);
                        next = next.other();
                    }
                });
            }
        });
        Swapper {
            stop,
            swaps,
            swap_nanos,
            max_swap_nanos,
            thread: Some(thread),
        }
    }

    /// Swaps made so far.
    pub fn swaps(&self) -> u64 {
        self.swaps.load(Relaxed)
    }

    /// Stops the thread (after its current tick) and says what it did.
    pub fn stop(mut self) -> SwapStats {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the swapper thread does not panic");
        }
        let swaps = self.swaps();
        let total = self.swap_nanos.load(Relaxed);
        SwapStats {
            swaps,
            mean: Duration::from_nanos(total.checked_div(swaps).unwrap_or(0)),
            max: Duration::from_nanos(self.max_swap_nanos.load(Relaxed)),
        }
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
