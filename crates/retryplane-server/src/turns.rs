//! Turns of the admin service's bounded work (reading a policy ahead, decoding it, checking it)
//! with a part kept for callers who may change the policies. Without it, a read-only token's
//! Validate calls, sent in a loop from a few dozen threads, held every turn, and an `apply`
//! during an incident waited behind them (20 s with 60 threads).

use std::sync::Arc;

use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};

use crate::auth::Credential;

/// Permits shared by every caller, and a few more only for callers who may change the
/// policies ([`may_change`]): such a caller takes whichever comes first.
#[derive(Clone, Debug)]
pub(crate) struct Turns {
    shared: Arc<Semaphore>,
    kept: Arc<Semaphore>,
}

impl Turns {
    /// `shared` permits for every caller and `kept` more for callers who may change the
    /// policies.
    pub(crate) fn new(shared: usize, kept: usize) -> Self {
        Self {
            shared: Arc::new(Semaphore::new(shared)),
            kept: Arc::new(Semaphore::new(kept)),
        }
    }

    /// `n` permits, of the shared ones, or for a caller who `may_change` the policies of
    /// whichever pool has them first (a wait given up on one pool gives back what it held
    /// there). An error only once the semaphores are closed, which they never are.
    pub(crate) async fn acquire(
        &self,
        n: u32,
        may_change: bool,
    ) -> Result<OwnedSemaphorePermit, AcquireError> {
        let shared = self.shared.clone().acquire_many_owned(n);
        if !may_change {
            return shared.await;
        }
        tokio::select! {
            biased;
            permit = shared => permit,
            permit = self.kept.clone().acquire_many_owned(n) => permit,
        }
    }

    /// The permits free in both pools (tests).
    #[cfg(test)]
    pub(crate) fn available_permits(&self) -> usize {
        self.shared.available_permits() + self.kept.available_permits()
    }
}

/// Whether the caller holding `credential` may change the policies: an `admin` token's, or
/// any caller when the control plane has no tokens file (its listeners are on loopback, and
/// every caller is an admin).
pub(crate) fn may_change(credential: Option<&Credential>) -> bool {
    credential.is_none_or(|c| c.role().may_change())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// With the shared permits held, a caller who may only read waits for one; a caller who
    /// may change the policies takes a kept one, and with those held too, waits for either.
    #[tokio::test]
    async fn a_caller_who_may_change_the_policies_takes_a_kept_turn_when_the_shared_ones_are_held()
    {
        let turns = Turns::new(2, 1);
        let held = [
            turns.acquire(1, false).await.unwrap(),
            turns.acquire(1, false).await.unwrap(),
        ];
        let short = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(short, turns.acquire(1, false))
                .await
                .is_err(),
            "a reader took a turn past the shared ones"
        );
        let writer = tokio::time::timeout(Duration::from_secs(10), turns.acquire(1, true))
            .await
            .expect("the writer waited with a kept turn free")
            .unwrap();
        assert!(
            tokio::time::timeout(short, turns.acquire(1, true))
                .await
                .is_err(),
            "a second writer took a turn with none free"
        );
        // Either pool serves a writer that waits: a shared turn given back first.
        let waiting = tokio::spawn({
            let turns = turns.clone();
            async move { turns.acquire(1, true).await.map(drop) }
        });
        drop(held);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the waiting writer did not take the shared turn given back")
            .unwrap()
            .unwrap();
        // The writer's wait on the kept pool was given up: the kept turn comes back whole.
        drop(writer);
        let again =
            tokio::time::timeout(Duration::from_secs(10), turns.kept.clone().acquire_owned())
                .await
                .expect("the kept turn was not given back");
        assert!(again.is_ok());
    }

    #[test]
    fn admins_and_callers_without_a_token_file_may_change_the_policies() {
        use crate::auth::Role;
        assert!(may_change(None));
        assert!(may_change(Some(&Credential::for_test(Role::Admin))));
        assert!(!may_change(Some(&Credential::for_test(Role::Viewer))));
    }
}
