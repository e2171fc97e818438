//! The line of hand-overs of one endpoint's budgets, or of its breakers: when a policy push
//! changes their settings, the new one takes over from the old ([`join_after`]), and a call
//! that read the policies just before the push gets one behind the newest ([`join_behind`]).
//! A member another took over from (or one behind) is *superseded*: its calls count in the
//! newest member of the line ([`newest`]), so an endpoint never has two deciding at once.
//!
//! The members are weak references, oldest first, under a mutex: it is touched when a member
//! joins, by the calls of a superseded member (and a breaker's opening and closing, passed on
//! to the others), and by a failure a breaker counts while closed (so that a hand-over's copy
//! and the failures counted meanwhile cannot miss each other; a budget does the same for its
//! retries with fences instead, `budget.rs`), never by the newest's other calls; a superseded
//! member whose newer members are gone clears its flag after one look ([`newest`]) and looks
//! no more.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Release;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

/// A budget or a breaker, as a member of its line.
pub(crate) trait Member: Sized {
    /// Its line, shared by every member.
    fn line(&self) -> &Line<Self>;
    /// Whether another member took over from it, or it runs behind the newest.
    fn superseded(&self) -> &AtomicBool;
}

/// The members of one line, oldest first (dropped ones linger until the next join or pruning
/// look). Empty for a member that never took over nor was taken over.
pub(crate) struct Line<T>(Mutex<Vec<Weak<T>>>);

impl<T> Default for Line<T> {
    fn default() -> Self {
        Self(Mutex::new(Vec::new()))
    }
}

impl<T> fmt::Debug for Line<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Line")
    }
}

impl<T> Line<T> {
    /// The members, whether or not a thread panicked holding them (the list is valid either
    /// way).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<Weak<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `new` takes over from `old`: it joins `old`'s line as its newest, and `old` is superseded;
/// then `then` runs, the line's lock still held (for the copy of `old`'s counts: what a member
/// does under the lock cannot come between the two, and a superseded member finds `new`
/// through the line only after it). `new` must have been made with `old`'s line.
pub(crate) fn join_after<T: Member>(old: &Arc<T>, new: &Arc<T>, then: impl FnOnce()) {
    let mut members = old.line().lock();
    if members.is_empty() {
        members.push(Arc::downgrade(old));
    }
    members.retain(|m| m.strong_count() > 0);
    members.push(Arc::downgrade(new));
    // Under the lock: `newest` clears it under the lock when the line has no other.
    old.superseded().store(true, Release);
    then();
}

/// `new` joins `newest`'s line just before it, superseded from the start: its calls count in
/// the newest. `new` must have been made with `newest`'s line.
pub(crate) fn join_behind<T: Member>(newest: &Arc<T>, new: &Arc<T>) {
    let mut members = newest.line().lock();
    if members.is_empty() {
        members.push(Arc::downgrade(newest));
    }
    members.retain(|m| m.strong_count() > 0);
    let at = members.len().saturating_sub(1);
    members.insert(at, Arc::downgrade(new));
    new.superseded().store(true, Release);
}

/// Whether another live member shares `this` one's line.
pub(crate) fn has_other<T: Member>(this: &T) -> bool {
    this.line()
        .lock()
        .iter()
        .any(|m| !std::ptr::eq(m.as_ptr(), this) && m.strong_count() > 0)
}

/// The newest live member of `this` one's line, other than `this`. When there is none (the
/// others are gone), `this` one is the line's newest again and stops looking: its flag is
/// cleared, under the lock.
pub(crate) fn newest<T: Member>(this: &T) -> Option<Arc<T>> {
    let mut members = this.line().lock();
    let newest = members
        .iter()
        .rev()
        .find_map(Weak::upgrade)
        .filter(|m| !std::ptr::eq(Arc::as_ptr(m), this));
    if newest.is_none() {
        members.retain(|m| m.strong_count() > 0);
        this.superseded().store(false, Release);
    }
    drop(members);
    newest
}

/// The other live members of `this` one's line (the dead ones pruned), to act on outside the
/// lock.
pub(crate) fn others<T: Member>(this: &T) -> Vec<Arc<T>> {
    let mut members = this.line().lock();
    members.retain(|m| m.strong_count() > 0);
    members
        .iter()
        .filter(|m| !std::ptr::eq(m.as_ptr(), this))
        .filter_map(Weak::upgrade)
        .collect()
}
