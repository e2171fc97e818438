//! How many connected agents run each policy version, per calling service: what a metrics
//! series goes by to decide which versions it keeps apart ([`crate::aggregate::series`]).
//!
//! The fleet ([`crate::fleet::Fleet`]) keeps the counts, under its own lock, at every change of
//! what a connected agent runs; the aggregator only reads them. An agent counts under the
//! number its calls are reported under: the number its Hello names (also one the fleet lists
//! as running none known, another store's content: its calls still carry that number), then
//! each version it ACKs. Counts of zero are removed, so the map holds at most one entry per
//! connected agent. The counts over every service (for the series that takes what is past the
//! caps) are summed when read: they are read rarely, and changed with every ACK.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Connected agents per (service, version).
#[derive(Debug, Default)]
pub struct AgentsRunning {
    inner: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    by_service: HashMap<Box<str>, HashMap<u64, u64>>,
}

impl Counts {
    fn add(&mut self, service: &str, version: u64) {
        match self.by_service.get_mut(service) {
            Some(versions) => *versions.entry(version).or_default() += 1,
            None => {
                self.by_service
                    .insert(service.into(), HashMap::from([(version, 1)]));
            }
        }
    }

    fn remove(&mut self, service: &str, version: u64) {
        if let Some(versions) = self.by_service.get_mut(service) {
            if let Some(n) = versions.get_mut(&version) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    versions.remove(&version);
                }
            }
            if versions.is_empty() {
                self.by_service.remove(service);
            }
        }
    }

    /// Agents of `service` (`None`: of every service) on `version`.
    fn on(&self, service: Option<&str>, version: u64) -> u64 {
        let of = |versions: &HashMap<u64, u64>| versions.get(&version).copied().unwrap_or(0);
        match service {
            Some(service) => self.by_service.get(service).map_or(0, of),
            None => self.by_service.values().map(of).sum(),
        }
    }
}

impl AgentsRunning {
    fn lock(&self) -> MutexGuard<'_, Counts> {
        // Plain counters, each change made whole under the lock.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An agent of `service` connected, running `version`.
    pub fn joined(&self, service: &str, version: u64) {
        self.lock().add(service, version);
    }

    /// An agent of `service` running `version` disconnected (or was replaced by a newer
    /// stream of its id).
    pub fn left(&self, service: &str, version: u64) {
        self.lock().remove(service, version);
    }

    /// A connected agent of `service` went from `from` to `to`.
    pub fn moved(&self, service: &str, from: u64, to: u64) {
        if from != to {
            let mut counts = self.lock();
            counts.remove(service, from);
            counts.add(service, to);
        }
    }

    /// Connected agents running `version`: of `service`, or of every service (`None`).
    pub fn agents(&self, service: Option<&str>, version: u64) -> u64 {
        self.with(service, |agents| agents(version))
    }

    /// Runs `f` with the count of agents of `service` (`None`: of every service) on a version,
    /// under one hold of the lock.
    fn with<T>(&self, service: Option<&str>, f: impl FnOnce(&dyn Fn(u64) -> u64) -> T) -> T {
        let counts = self.lock();
        f(&|version| counts.on(service, version))
    }

    /// One series' view: the agents of `service` (`None`: of every service).
    pub fn of<'a>(&'a self, service: Option<&'a str>) -> RunningOf<'a> {
        RunningOf {
            running: Some(self),
            service,
        }
    }
}

/// The connected agents running each version, as one series counts them: those of its
/// service, or of every service for the series that takes what is past the caps. The default
/// knows of no agent (every version has none).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunningOf<'a> {
    running: Option<&'a AgentsRunning>,
    service: Option<&'a str>,
}

impl RunningOf<'_> {
    /// Runs `f` with the count of agents on a version, under one hold of the counts' lock
    /// (none is taken with no fleet): for a choice that reads several versions' counts.
    pub fn with<T>(&self, f: impl FnOnce(&dyn Fn(u64) -> u64) -> T) -> T {
        match self.running {
            Some(r) => r.with(self.service, f),
            None => f(&|_| 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_are_counted_per_service_and_over_every_service_and_zero_counts_go() {
        let running = AgentsRunning::default();
        running.joined("checkout", 3);
        running.joined("checkout", 3);
        running.joined("search", 3);
        running.joined("search", 2);
        assert_eq!(running.agents(Some("checkout"), 3), 2);
        assert_eq!(running.agents(Some("search"), 3), 1);
        assert_eq!(running.agents(None, 3), 3);
        assert_eq!(running.agents(None, 2), 1);
        running.moved("search", 2, 4);
        assert_eq!(running.agents(Some("search"), 2), 0);
        assert_eq!(running.of(Some("search")).with(|on| on(4)), 1);
        running.moved("checkout", 3, 3);
        assert_eq!(running.agents(Some("checkout"), 3), 2);
        for (service, version) in [
            ("checkout", 3),
            ("checkout", 3),
            ("search", 3),
            ("search", 4),
        ] {
            running.left(service, version);
        }
        let counts = running.lock();
        assert!(counts.by_service.is_empty(), "{counts:?}");
    }

    #[test]
    fn a_view_of_no_fleet_knows_of_no_agent() {
        assert_eq!(RunningOf::default().with(|on| on(1)), 0);
    }
}
