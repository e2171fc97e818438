//! How many connections each gRPC listener holds at once.
//!
//! Every connection holds one of the process's file descriptors, and nothing capped the gRPC
//! listeners: a peer that opened connections faster than they were closed for idleness took
//! every descriptor, and then the HTTP listener's health probes, the admin API, a reload of the
//! tokens file and the store's own files failed with "too many open files" too (a probe that
//! fails gets the control plane restarted, and its whole fleet reconnects). So each gRPC
//! listener holds at most a number of connections (`Capped`): past it, the next is accepted
//! once one closes, and the rest wait in the kernel's queue, holding no descriptor of the
//! process (as the HTTP listener does, `crate::idle::MAX_CONNECTIONS`). The admin listener
//! holds [`ADMIN_MAX_CONNECTIONS`]; the agent listener room for each agent's connection and a
//! second while it reconnects; all three no more than the open-file limit leaves beside
//! [`RESERVED_FILES`] ([`listener_caps`]: under a limit of 1,152 the admin and HTTP listeners
//! hold a quarter of what it leaves each, so that no listener's flood takes the others').
//!
//! With a tokens file, a full listener accepts the next connection all the same (one descriptor
//! past the cap) and makes room for it by closing the oldest of its connections on which no
//! token has admitted a call yet (`Evictable`; nothing is closed while no connection waits): otherwise a peer with no token kept
//! the admin listener full with 26 silent connections a second (each kept 10 s), and every
//! admin client waited in the kernel's queue for good. A client with a token calls at once, so
//! it is evicted only by a flood that fills every place within its first round trip.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::Stream;

use crate::conn_idle::Streams;

/// The task a connection's eviction wakes: the last one registered while a read or write
/// waited (a connection's reads and writes run in one task). Shared by the gRPC listeners'
/// connections ([`crate::conn_idle::Streams`]) and the HTTP listener's.
#[derive(Debug, Default)]
pub(crate) struct WakerSlot(Mutex<Option<std::task::Waker>>);

impl WakerSlot {
    /// Keeps `task` to wake (unless the one kept already wakes it).
    pub(crate) fn register(&self, task: &std::task::Waker) {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !slot.as_ref().is_some_and(|w| w.will_wake(task)) {
            *slot = Some(task.clone());
        }
    }

    /// Wakes the task kept, if any.
    pub(crate) fn wake(&self) {
        let waiting = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = waiting {
            task.wake();
        }
    }
}

/// Most connections the admin listener holds at once: admin clients (the CLI, a CI job, a
/// dashboard's `top`) hold one each for as long as they run.
pub const ADMIN_MAX_CONNECTIONS: usize = 256;

/// File descriptors kept beside the listeners' connections: the listening sockets, the store,
/// the policy and tokens files while they are read, the file watcher, the runtime's own, and
/// standard input and outputs.
pub const RESERVED_FILES: u64 = 128;

/// How many connections each listener holds at once ([`listener_caps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerCaps {
    /// The agent listener's.
    pub agent: usize,
    /// The admin listener's ([`ADMIN_MAX_CONNECTIONS`] unless the open-file limit is low).
    pub admin: usize,
    /// The HTTP listener's (`crate::idle::MAX_CONNECTIONS`, 256, unless the open-file limit is
    /// low).
    pub http: usize,
}

/// The listeners' caps under the open-file limit `open_files` (`None`: unknown or unlimited),
/// with `wanted` the agent listener's (the configured cap, or `max_agents` twice plus the
/// pending handshakes), and whether the limit lowered the agent listener's. What the limit
/// leaves beside [`RESERVED_FILES`] is shared: the admin and HTTP listeners hold their usual
/// 256 each, or a quarter of it each when that is less (under a limit of 1,152), and the agent
/// listener the rest; each at least 1. Without the quarters, a limit of 256 left the agent
/// listener 1 connection and the HTTP listener's 256 places more descriptors than the
/// process had, so a flood of it failed the probes and the policy file's reads.
pub fn listener_caps(wanted: usize, open_files: Option<u64>) -> (ListenerCaps, bool) {
    let usual = ListenerCaps {
        agent: wanted,
        admin: ADMIN_MAX_CONNECTIONS,
        http: crate::idle::MAX_CONNECTIONS,
    };
    let Some(limit) = open_files else {
        return (usual, false);
    };
    let room = usize::try_from(limit.saturating_sub(RESERVED_FILES)).unwrap_or(usize::MAX);
    let quarter = (room / 4).max(1);
    let (admin, http) = (usual.admin.min(quarter), usual.http.min(quarter));
    let agent_room = room.saturating_sub(admin + http).max(1);
    let caps = ListenerCaps {
        agent: wanted.min(agent_room),
        admin,
        http,
    };
    (caps, wanted > agent_room)
}

/// The process's open-file limit (the soft one, which `open` is held to); `None` when it is
/// unlimited or cannot be read here.
pub fn open_file_limit() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Raises the process's open-file limit to its hard limit when the soft one is lower (as Go's
/// runtime does at start: the soft limit is often 1,024 for compatibility with `select`, which
/// nothing here uses). What the soft limit is afterwards, as [`open_file_limit`].
pub fn raise_open_file_limit() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let limits = getrlimit(Resource::Nofile);
        if let (Some(current), maximum) = (limits.current, limits.maximum)
            && maximum.is_none_or(|max| max > current)
        {
            let raised = rustix::process::Rlimit {
                current: maximum,
                maximum,
            };
            // A failure leaves the limit as it was, which is then what the caps fit.
            if let Err(e) = setrlimit(Resource::Nofile, raised) {
                tracing::debug!(error = %e, "cannot raise the open-file limit");
            }
        }
    }
    open_file_limit()
}

/// The connections of a listener with a tokens file on which no token may have admitted a call
/// yet, oldest first: what a full listener closes to make room (see the module docs).
#[derive(Debug)]
pub(crate) struct Evictable {
    /// Connections in the order they were accepted; those that have ended or been admitted
    /// are let go as they reach the front, or all at once when the queue grows past twice the
    /// listener's cap.
    queue: Mutex<VecDeque<Weak<Streams>>>,
    /// The listener's cap: at most that many listed connections are alive.
    max: usize,
}

impl Evictable {
    /// For a listener that holds `max` connections.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            queue: Mutex::default(),
            max,
        }
    }

    /// Lists a connection just accepted.
    pub(crate) fn push(&self, streams: &Arc<Streams>) {
        let gone = |listed: &Weak<Streams>| listed.upgrade().is_none_or(|s| s.is_admitted());
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while queue.front().is_some_and(gone) {
            queue.pop_front();
        }
        // A connection with a call no token admitted (a health check) may stay at the front
        // for the idle timeout: past twice the cap, those behind it that are gone are let go
        // too (at most `max` are alive, so this runs once every `max` pushes at most).
        if queue.len() >= self.max.saturating_mul(2).max(64) {
            queue.retain(|listed| !gone(listed));
        }
        queue.push_back(Arc::downgrade(streams));
    }

    /// Closes the oldest listed connection no token has admitted a call on; whether there was
    /// one.
    pub(crate) fn evict_oldest(&self) -> bool {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(oldest) = queue.pop_front() {
            // Not one a token has admitted a call on, even meanwhile (`evict` decides).
            if let Some(streams) = oldest.upgrade()
                && streams.evict()
            {
                tracing::debug!("a full listener closed a connection no token was admitted on");
                return true;
            }
        }
        false
    }
}

/// A listener's accepted connections, each with the place it holds: one is accepted only once a
/// place is free (the rest wait in the kernel's queue). With `evictable` connections (a tokens
/// file), a full listener accepts the next connection that comes all the same, holds it (one
/// descriptor past the cap), closes the oldest listed connection no token has admitted a call
/// on, and hands the held one out with the place that frees (see the module docs): nothing is
/// closed while no connection waits.
pub(crate) struct Capped<S, T> {
    accepted: S,
    places: Arc<Semaphore>,
    evictable: Option<Arc<Evictable>>,
    /// The place the next connection will hold, taken before its accept.
    place: Option<OwnedSemaphorePermit>,
    /// Waits for a place while all are held.
    waiting: Option<Pin<Box<dyn Future<Output = OwnedSemaphorePermit> + Send>>>,
    /// A connection accepted while every place was held, waiting for the place its eviction
    /// of another frees.
    held: Option<T>,
}

impl<S, T> Capped<S, T> {
    /// `accepted`'s connections, `max` at once; a full listener closes the oldest of
    /// `evictable` (with a tokens file) for a connection that waits.
    pub(crate) fn new(accepted: S, max: usize, evictable: Option<Arc<Evictable>>) -> Self {
        Self {
            accepted,
            places: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            evictable,
            place: None,
            waiting: None,
            held: None,
        }
    }

    /// A place, once one is free (the waker registered until then).
    fn poll_place(&mut self, cx: &mut Context<'_>) -> Poll<OwnedSemaphorePermit> {
        let places = self.places.clone();
        let waiting = self.waiting.get_or_insert_with(|| {
            Box::pin(async move {
                loop {
                    // The semaphore is never closed: `Err` cannot come.
                    if let Ok(place) = places.clone().acquire_owned().await {
                        return place;
                    }
                }
            })
        });
        let place = ready!(waiting.as_mut().poll(cx));
        self.waiting = None;
        Poll::Ready(place)
    }
}

impl<S, T> Stream for Capped<S, T>
where
    S: Stream<Item = io::Result<T>> + Unpin,
    T: Unpin,
{
    type Item = io::Result<(T, OwnedSemaphorePermit)>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // Bounded: each turn takes a place, or a connection, or returns.
        loop {
            if let Some(place) = this.place.take() {
                return match Pin::new(&mut this.accepted).poll_next(cx) {
                    Poll::Ready(Some(Ok(connection))) => Poll::Ready(Some(Ok((connection, place)))),
                    Poll::Ready(Some(Err(e))) => {
                        // The place waits for the next connection.
                        this.place = Some(place);
                        Poll::Ready(Some(Err(e)))
                    }
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => {
                        this.place = Some(place);
                        Poll::Pending
                    }
                };
            }
            if this.held.is_some() {
                let place = ready!(this.poll_place(cx));
                return match this.held.take() {
                    Some(connection) => Poll::Ready(Some(Ok((connection, place)))),
                    None => {
                        this.place = Some(place);
                        continue;
                    }
                };
            }
            if let Poll::Ready(place) = this.poll_place(cx) {
                this.place = Some(place);
                continue;
            }
            // Full.
            let Some(evictable) = this.evictable.clone() else {
                return Poll::Pending;
            };
            return match Pin::new(&mut this.accepted).poll_next(cx) {
                Poll::Ready(Some(Ok(connection))) => {
                    // A place freed meanwhile (a connection ended on another thread) is its.
                    if let Poll::Ready(place) = this.poll_place(cx) {
                        return Poll::Ready(Some(Ok((connection, place))));
                    }
                    // Room for it, once the one closed lets go of its place.
                    evictable.evict_oldest();
                    this.held = Some(connection);
                    continue;
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt as _;

    use super::*;

    #[test]
    fn the_listeners_caps_are_lowered_to_what_the_open_file_limit_leaves() {
        let caps = |agent, admin, http| ListenerCaps { agent, admin, http };
        let others = (ADMIN_MAX_CONNECTIONS + crate::idle::MAX_CONNECTIONS) as u64 + RESERVED_FILES;
        assert_eq!(listener_caps(21_024, None), (caps(21_024, 256, 256), false));
        assert_eq!(
            listener_caps(21_024, Some(1_048_576)),
            (caps(21_024, 256, 256), false)
        );
        assert_eq!(
            listener_caps(21_024, Some(20_000)),
            (caps(20_000 - others as usize, 256, 256), true)
        );
        assert_eq!(
            listener_caps(100, Some(1_252)),
            (caps(100, 256, 256), false)
        );
        assert_eq!(
            listener_caps(1_000, Some(1_252)),
            (caps(612, 256, 256), true)
        );
        assert_eq!(
            listener_caps(100, Some(others + 100)),
            (caps(100, 153, 153), false)
        );
        // Under 1,152 the admin and HTTP listeners hold a quarter of what the limit leaves
        // each, the agent listener the rest: every listener keeps places of its own.
        assert_eq!(
            listener_caps(41_024, Some(1_024)),
            (caps(448, 224, 224), true)
        );
        assert_eq!(listener_caps(41_024, Some(256)), (caps(64, 32, 32), true));
        assert_eq!(listener_caps(10, Some(256)), (caps(10, 32, 32), false));
        // The caps and the reserve never pass the limit, down to where each listener holds 1.
        for limit in 131..3_000u64 {
            let (c, _) = listener_caps(usize::MAX, Some(limit));
            assert!(
                (c.agent + c.admin + c.http) as u64 + RESERVED_FILES <= limit,
                "{limit}"
            );
            assert!(c.agent >= c.admin && c.admin >= 1, "{limit}: {c:?}");
        }
        // A limit that leaves nothing still lets one connection in on each.
        assert_eq!(listener_caps(5, Some(64)), (caps(1, 1, 1), true));
    }

    /// The oldest connection not admitted is the one evicted; admitted, ended and evicted ones
    /// are passed over.
    #[test]
    fn the_oldest_connection_no_token_admitted_is_evicted() {
        let now = tokio::time::Instant::now();
        let connection = || Arc::new(Streams::new(now).guarded(true));
        let evictable = Evictable::new(4);
        let (admitted, ended, oldest, newest) =
            (connection(), connection(), connection(), connection());
        for c in [&admitted, &ended, &oldest, &newest] {
            evictable.push(c);
        }
        crate::conn_idle::Admitted::on_streams(admitted.clone()).admit();
        drop(ended);
        assert!(evictable.evict_oldest());
        assert!(oldest.is_evicted());
        assert!(!newest.is_evicted() && !admitted.is_evicted());
        assert!(evictable.evict_oldest());
        assert!(newest.is_evicted());
        assert!(!evictable.evict_oldest(), "none left to evict");
        assert!(!admitted.is_evicted());
    }

    /// Connections the test numbers and sends, as a listener would accept them.
    type Queue = tokio_stream::wrappers::UnboundedReceiverStream<io::Result<u32>>;

    /// A listener of `max` places over connections the test sends on the sender.
    fn capped(
        max: usize,
        evictable: Option<Arc<Evictable>>,
    ) -> (
        tokio::sync::mpsc::UnboundedSender<io::Result<u32>>,
        Capped<Queue, u32>,
    ) {
        let (send, receive) = tokio::sync::mpsc::unbounded_channel();
        (send, Capped::new(Queue::new(receive), max, evictable))
    }

    /// Sends and takes `n` connections, each listed in `evictable` with streams of its own: the
    /// streams and the places they hold, in order.
    async fn fill<S>(
        capped: &mut Capped<S, u32>,
        send: &tokio::sync::mpsc::UnboundedSender<io::Result<u32>>,
        evictable: &Evictable,
        n: u32,
    ) -> Vec<(Arc<Streams>, OwnedSemaphorePermit)>
    where
        S: Stream<Item = io::Result<u32>> + Unpin,
    {
        let mut held = Vec::new();
        for i in 0..n {
            send.send(Ok(i)).unwrap();
            let (connection, place) = capped.next().await.unwrap().unwrap();
            assert_eq!(connection, i);
            let streams = Arc::new(Streams::new(tokio::time::Instant::now()).guarded(true));
            evictable.push(&streams);
            held.push((streams, place));
        }
        held
    }

    /// `capped.next()` polled once: what it gives at once, or `None` while it waits.
    async fn at_once<S: Stream + Unpin>(capped: &mut S) -> Option<Option<S::Item>> {
        let mut next = Box::pin(capped.next());
        match std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await {
            Poll::Ready(item) => Some(item),
            Poll::Pending => None,
        }
    }

    /// With a tokens file, a full listener closes nothing while no connection waits; one that
    /// comes is accepted and held, the oldest connection no token admitted is evicted, and
    /// the held one is handed out with the place that frees.
    #[tokio::test]
    async fn a_full_listener_evicts_only_for_a_connection_that_waits() {
        let evictable = Arc::new(Evictable::new(2));
        let (send, mut capped) = capped(2, Some(evictable.clone()));
        let mut held = fill(&mut capped, &send, &evictable, 2).await;
        // Full, and nobody waits: nothing is closed, however often it is polled.
        for _ in 0..3 {
            assert!(at_once(&mut capped).await.is_none());
        }
        assert!(held.iter().all(|(s, _)| !s.is_evicted()));
        // The first was admitted; a third connection comes: the second is evicted for it.
        crate::conn_idle::Admitted::on_streams(held[0].0.clone()).admit();
        send.send(Ok(2)).unwrap();
        assert!(at_once(&mut capped).await.is_none(), "waits for the place");
        assert!(!held[0].0.is_evicted() && held[1].0.is_evicted());
        // The evicted connection ends: the third has its place.
        drop(held.remove(1));
        let (third, _place) = capped.next().await.unwrap().unwrap();
        assert_eq!(third, 2);
    }

    /// Without a tokens file (nothing evictable), a full listener leaves the next connection
    /// in the queue: it is not accepted until a place frees.
    #[tokio::test]
    async fn without_tokens_a_full_listener_accepts_nothing_more() {
        let (send, mut capped) = capped(1, None);
        send.send(Ok(0)).unwrap();
        let (_, place) = capped.next().await.unwrap().unwrap();
        send.send(Ok(1)).unwrap();
        assert!(at_once(&mut capped).await.is_none());
        drop(place);
        assert_eq!(capped.next().await.unwrap().unwrap().0, 1);
    }

    #[tokio::test]
    async fn a_connection_is_taken_only_once_a_place_is_free() {
        let (send, mut capped) = capped(2, None);
        for n in 0..3 {
            send.send(Ok(n)).unwrap();
        }
        let (first, first_place) = capped.next().await.unwrap().unwrap();
        let (second, _second_place) = capped.next().await.unwrap().unwrap();
        assert_eq!((first, second), (0, 1));
        // Both places held: the third, waiting in the queue, is not taken.
        let mut third = Box::pin(capped.next());
        let polled = std::future::poll_fn(|cx| Poll::Ready(third.as_mut().poll(cx))).await;
        assert!(polled.is_pending());
        drop(first_place);
        let (third, _) = third.await.unwrap().unwrap();
        assert_eq!(third, 2);
    }

    /// Connections that ended or were admitted behind one that stays at the front are let go
    /// once the list reaches twice the cap.
    #[test]
    fn the_list_of_evictable_connections_stays_bounded() {
        let now = tokio::time::Instant::now();
        let evictable = Evictable::new(32);
        let front = Arc::new(Streams::new(now).guarded(true));
        evictable.push(&front);
        for _ in 0..10_000 {
            // Each one ends at once.
            evictable.push(&Arc::new(Streams::new(now).guarded(true)));
        }
        let listed = evictable.queue.lock().unwrap().len();
        assert!(listed <= 64, "{listed} listed");
        assert!(evictable.evict_oldest());
        assert!(front.is_evicted());
    }

    /// Accepted connections that, as one is taken, let `ending` go first: a connection that
    /// ended on another thread while the listener's task was between its two polls.
    struct EndsAsItAccepts {
        inner: tokio_stream::wrappers::UnboundedReceiverStream<io::Result<u32>>,
        ending: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
    }

    impl Stream for EndsAsItAccepts {
        type Item = io::Result<u32>;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            drop(self.ending.lock().unwrap().take());
            Pin::new(&mut self.inner).poll_next(cx)
        }
    }

    /// A place that frees between the wait for a place and the accept is the new connection's:
    /// no connection is evicted for it.
    #[tokio::test]
    async fn a_place_freed_while_accepting_evicts_nothing() {
        let (send, receive) = tokio::sync::mpsc::unbounded_channel::<io::Result<u32>>();
        let ending = Arc::new(Mutex::new(None));
        let evictable = Arc::new(Evictable::new(2));
        let mut capped = Capped::new(
            EndsAsItAccepts {
                inner: tokio_stream::wrappers::UnboundedReceiverStream::new(receive),
                ending: ending.clone(),
            },
            2,
            Some(evictable.clone()),
        );
        let mut held = fill(&mut capped, &send, &evictable, 2).await;
        // The first connection ends just as the third is accepted.
        let (first, first_place) = held.remove(0);
        drop(first);
        *ending.lock().unwrap() = Some(first_place);
        send.send(Ok(2)).unwrap();
        let third = tokio::time::timeout(std::time::Duration::from_secs(1), capped.next())
            .await
            .expect("the third connection was not handed out");
        assert_eq!(third.unwrap().unwrap().0, 2);
        assert!(
            !held[0].0.is_evicted(),
            "the second was evicted though a place was free"
        );
    }

    /// The held connection is handed out when the evicted one lets go of its place while the
    /// listener's task waits (woken, not merely found at the next poll).
    #[tokio::test]
    async fn the_held_connection_is_woken_out() {
        let evictable = Arc::new(Evictable::new(1));
        let (send, mut capped) = capped(1, Some(evictable.clone()));
        let (streams, place) = fill(&mut capped, &send, &evictable, 1).await.remove(0);
        let task = tokio::spawn(async move { capped.next().await.map(|c| c.map(|c| c.0)) });
        send.send(Ok(1)).unwrap();
        let evicted = async {
            while !streams.is_evicted() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(1), evicted)
            .await
            .expect("the first connection was not evicted");
        drop(place);
        let got = tokio::time::timeout(std::time::Duration::from_secs(1), task)
            .await
            .expect("lost wakeup");
        assert_eq!(got.unwrap().unwrap().unwrap(), 1);
    }
}
