//! Budgets and breakers of calls that read the policies just before a push that turned them
//! off, with chosen instants.

use std::time::Duration;

use retryplane_policy::breaker::BreakerState;
use retryplane_policy::engine::EndpointState;
use retryplane_policy::model::{BreakerConfig, BudgetConfig, RetryPolicy};
use tokio::time::Instant;

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

/// A budget of 2 retries per second (20 per 10 s window) and no ratio.
fn with_budget() -> RetryPolicy {
    RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 2,
            window: Duration::from_secs(10),
        }),
        circuit_breaker: None,
        ..RetryPolicy::default()
    }
}

/// A push turns the budget off for an endpoint the policies do not name. Calls that read the
/// policies just before it reach the endpoint after it, and each gets a state behind the
/// newest (the agent builds one per such call). Their policy still has the budget (they keep
/// their policy), and they share one: each with a fresh budget of its own, 60 such calls sent
/// 60 retries in one second where their budget allows 20 per window.
#[test]
fn calls_behind_a_newest_state_without_a_budget_share_one_budget_of_their_own_settings() {
    let t0 = Instant::now();
    let newest = EndpointState::new(
        &RetryPolicy {
            budget: None,
            ..with_budget()
        },
        t0,
    );
    let old = with_budget();
    let stragglers: Vec<EndpointState> = (0..60).map(|_| newest.behind(&old)).collect();
    let sent = stragglers
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            let now = ms(t0, 100 + *i as u64);
            s.budget().unwrap().deposit(now);
            s.budget().unwrap().try_withdraw(now)
        })
        .count();
    assert!(
        sent <= 20,
        "{sent} retries in one second, each straggler call with a fresh budget of 20 per window"
    );
}

/// The same for a breaker the push turned off: the calls behind the newest state share one,
/// which opens on their failures (each with a breaker of its own, none ever saw enough calls
/// to open).
#[test]
fn calls_behind_a_newest_state_without_a_breaker_share_one_breaker_of_their_own_settings() {
    let t0 = Instant::now();
    let old = RetryPolicy {
        budget: None,
        circuit_breaker: Some(BreakerConfig {
            min_requests: 5,
            ..BreakerConfig::default()
        }),
        ..RetryPolicy::default()
    };
    let newest = EndpointState::new(
        &RetryPolicy {
            circuit_breaker: None,
            ..old.clone()
        },
        t0,
    );
    let stragglers: Vec<EndpointState> = (0..10).map(|_| newest.behind(&old)).collect();
    for (i, s) in stragglers.iter().enumerate() {
        let now = ms(t0, 100 + i as u64);
        let breaker = s.breaker().unwrap();
        if let Ok(permit) = breaker.try_acquire(now) {
            breaker.record(permit, false, now);
        }
    }
    let now = ms(t0, 200);
    assert_eq!(
        stragglers[9].breaker().unwrap().state(now),
        BreakerState::Open,
        "ten failures of ten calls where five open it"
    );
}

// Budgets of other settings, and pushes that change the newest state again.

/// The same budget as [`with_budget`] under other numbers (4 retries per second).
fn with_other_budget() -> RetryPolicy {
    RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 4,
            window: Duration::from_secs(10),
        }),
        circuit_breaker: None,
        ..RetryPolicy::default()
    }
}

fn without_budget() -> RetryPolicy {
    RetryPolicy {
        budget: None,
        ..with_budget()
    }
}

/// Retries the stragglers of `states` get, one deposit and one withdrawal each, at 1 ms steps
/// from `from` ms after `t0`.
fn retries_sent<'a>(
    t0: Instant,
    from: u64,
    states: impl Iterator<Item = &'a EndpointState>,
) -> usize {
    states
        .enumerate()
        .filter(|(i, s)| {
            let now = ms(t0, from + *i as u64);
            // A state without a budget sends every retry.
            s.budget().is_none_or(|b| {
                b.deposit(now);
                b.try_withdraw(now)
            })
        })
        .count()
}

/// Two older versions alive at once, with two budget settings, behind a newest state that
/// has none: their calls come in turn. The stray slot keeps only the last made, so each call
/// of one finds the other's settings there and makes a fresh budget: the calls of
/// `with_budget` sent one retry each (30) where their budget allows 20 a window.
#[test]
fn calls_of_two_older_versions_coming_in_turn_still_share_one_budget_each() {
    let t0 = Instant::now();
    let newest = EndpointState::new(&without_budget(), t0);
    let (a, b) = (with_budget(), with_other_budget());
    let mut of_a = Vec::new();
    let mut of_b = Vec::new();
    for _ in 0..30 {
        of_a.push(newest.behind(&a));
        of_b.push(newest.behind(&b));
    }
    let sent = retries_sent(t0, 100, of_a.iter());
    assert!(
        sent <= 20,
        "{sent} retries of the calls of one setting in one second, whose budget allows 20 a \
         window: each got a fresh budget as the other version's calls came in between"
    );
}

/// The newest state (no budget) is replaced by a push that changes only its breaker: the
/// budget part is unchanged (off, and off), but the calls behind the new newest state get a
/// second stray budget beside the one the calls behind the old one still use, with a fresh
/// allowance (40 retries where 20 a window are allowed). `carry` shares a part whose settings
/// did not change so that a new window does not let a storm start again; the strays are not.
#[test]
fn a_push_that_changes_only_the_breaker_of_the_newest_state_adds_no_second_stray_budget() {
    let t0 = Instant::now();
    let newest = EndpointState::new(&without_budget(), t0);
    let old = with_budget();
    let before: Vec<EndpointState> = (0..30).map(|_| newest.behind(&old)).collect();
    let sent_before = retries_sent(t0, 100, before.iter());
    let replaced = newest.carry(
        &RetryPolicy {
            circuit_breaker: Some(BreakerConfig {
                min_requests: 7,
                ..BreakerConfig::default()
            }),
            ..without_budget()
        },
        ms(t0, 150),
    );
    let after: Vec<EndpointState> = (0..30).map(|_| replaced.behind(&old)).collect();
    let sent_after = retries_sent(t0, 200, after.iter());
    assert!(
        sent_before + sent_after <= 20,
        "{sent_before} + {sent_after} retries in one second by calls of one budget setting \
         (20 a window), the calls before them still running"
    );
}

/// Off, then on again with the settings the calls behind it use: the newest state's budget is
/// made afresh beside the stray one those calls still spend, so calls of one setting get two
/// allowances in one window (40 where 20 are allowed).
#[test]
fn a_budget_turned_on_again_with_the_strays_settings_takes_their_budget_over() {
    let t0 = Instant::now();
    let off = EndpointState::new(&without_budget(), t0);
    let old = with_budget();
    let stragglers: Vec<EndpointState> = (0..30).map(|_| off.behind(&old)).collect();
    let sent_stray = retries_sent(t0, 100, stragglers.iter());
    let on = off.carry(&old, ms(t0, 150));
    let calls: Vec<&EndpointState> = std::iter::repeat_n(&on, 30).collect();
    let sent_on = retries_sent(t0, 200, calls.into_iter());
    assert!(
        sent_stray + sent_on <= 20,
        "{sent_stray} + {sent_on} retries in one second under one budget setting (20 a \
         window), the stray calls still running"
    );
}

/// A budget turned off by one push and on again by the next (same settings) is the one the
/// calls still running on the first use, not a fresh one beside it: one reserve in one window.
#[test]
fn a_budget_turned_off_and_on_again_adds_no_budget_beside_the_one_calls_still_use() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    let v3 = v2.carry(&with_budget(), ms(t0, 200));
    // Calls still on v1 retry, then calls on v3 do.
    let sent = retries_sent(t0, 300, [&v1, &v3].into_iter().cycle().take(60));
    assert!(
        sent <= 20,
        "one endpoint sent {sent} retries against 20 a window"
    );
}

/// A breaker turned off by one push and on again by the next (same settings) is the one the
/// calls still running on the first use: their failures open the endpoint's breaker.
#[test]
fn a_breaker_turned_off_and_on_again_opens_when_the_calls_still_on_the_first_one_open_it() {
    let t0 = Instant::now();
    let cfg = BreakerConfig {
        min_requests: 10,
        ..BreakerConfig::default()
    };
    let with = |b: Option<BreakerConfig>| RetryPolicy {
        circuit_breaker: b,
        ..RetryPolicy::default()
    };
    let v1 = EndpointState::new(&with(Some(cfg.clone())), t0);
    let old = v1.breaker().unwrap();
    let permits: Vec<_> = (0..10).map(|_| old.try_acquire(t0).unwrap()).collect();
    let v2 = v1.carry(&with(None), ms(t0, 100));
    let v3 = v2.carry(&with(Some(cfg)), ms(t0, 200));
    let at = ms(t0, 300);
    permits.into_iter().for_each(|p| old.record(p, false, at));
    assert_eq!(old.state(at), BreakerState::Open);
    assert_eq!(
        v3.breaker().unwrap().state(at),
        BreakerState::Open,
        "the endpoint's breaker"
    );
}

// Turned off, then on again with other settings; and older versions' calls.

/// A breaker the calls still running opened is turned off by one push and on again by the
/// next with other numbers (here `min_requests`): the new one takes over from the open one
/// and stays open, as a settings change made by one push does (`CircuitBreaker::taking_over`:
/// "a settings change never lets full traffic through to an upstream the breaker had cut
/// off"), not closed beside it.
#[test]
fn a_breaker_turned_off_and_on_again_with_other_settings_does_not_close_an_open_one() {
    let t0 = Instant::now();
    let cfg = BreakerConfig {
        min_requests: 10,
        ..BreakerConfig::default()
    };
    let with = |b: Option<BreakerConfig>| RetryPolicy {
        budget: None,
        circuit_breaker: b,
        ..RetryPolicy::default()
    };
    let v1 = EndpointState::new(&with(Some(cfg.clone())), t0);
    let old = v1.breaker().unwrap();
    let permits: Vec<_> = (0..10).map(|_| old.try_acquire(t0).unwrap()).collect();
    permits
        .into_iter()
        .for_each(|p| old.record(p, false, ms(t0, 50)));
    assert_eq!(old.state(ms(t0, 50)), BreakerState::Open);
    let v2 = v1.carry(&with(None), ms(t0, 100));
    let v3 = v2.carry(
        &with(Some(BreakerConfig {
            min_requests: 7,
            ..cfg
        })),
        ms(t0, 200),
    );
    let at = ms(t0, 300);
    assert_eq!(old.state(at), BreakerState::Open, "open for 30 s");
    // One push changing the numbers: still open.
    let direct = v1.carry(
        &with(Some(BreakerConfig {
            min_requests: 7,
            ..cfg.clone()
        })),
        ms(t0, 200),
    );
    assert_eq!(direct.breaker().unwrap().state(at), BreakerState::Open);
    assert_eq!(
        v3.breaker().unwrap().state(at),
        BreakerState::Open,
        "the endpoint's breaker, opened 250 ms before by the calls still on it"
    );
}

/// The same for a budget. The calls still on v1 spent their budget (20 a window); two pushes
/// turn it off and on again with a tighter one (10 a window): the new one takes over the
/// spent one and refuses at once, as one push tightening it does (`RetryBudget::taking_over`),
/// not 10 more retries in the same window.
#[test]
fn a_budget_turned_off_and_on_again_tighter_hands_out_no_fresh_allowance() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let spent = retries_sent(t0, 0, std::iter::repeat_n(&v1, 30));
    assert_eq!(spent, 20);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    let tighter = RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 1,
            window: Duration::from_secs(10),
        }),
        ..with_budget()
    };
    // One push tightening it: refused at once.
    let w1 = EndpointState::new(&with_budget(), t0);
    assert_eq!(retries_sent(t0, 0, std::iter::repeat_n(&w1, 30)), 20);
    let w2 = w1.carry(&tighter, ms(t0, 200));
    assert_eq!(retries_sent(t0, 300, std::iter::repeat_n(&w2, 30)), 0);
    // Two pushes.
    let v3 = v2.carry(&tighter, ms(t0, 200));
    let after = retries_sent(t0, 300, std::iter::repeat_n(&v3, 30));
    assert_eq!(
        after, 0,
        "{after} retries handed out by the tightened budget, the endpoint having sent 20 in \
         this window"
    );
}

/// Calls of an older version (`with_other_budget`, 40 a window) behind the newest state count
/// in its budget (`with_budget`: they join its line and withdraw there, 20 a window, spent).
/// A push turns the newest budget off; it is kept for the calls still on it, and the older
/// version's calls that come after the push count in it too (through one made behind it),
/// not in a fresh budget of their own settings (20 + 30 retries in one second, where even
/// their own budget allows 40).
#[test]
fn calls_of_an_older_version_get_no_fresh_budget_when_the_newest_one_is_turned_off() {
    let t0 = Instant::now();
    let newest = EndpointState::new(&with_budget(), t0);
    let older = with_other_budget();
    let before: Vec<EndpointState> = (0..30).map(|_| newest.behind(&older)).collect();
    let sent_before = retries_sent(t0, 100, before.iter());
    let off = newest.carry(&without_budget(), ms(t0, 150));
    let after: Vec<EndpointState> = (0..30).map(|_| off.behind(&older)).collect();
    let sent_after = retries_sent(t0, 200, after.iter());
    assert!(
        sent_before + sent_after <= 40,
        "{sent_before} + {sent_after} retries in one second by calls of one older version, \
         whose own budget allows 40 a window, the calls before the push still running"
    );
}

// A push turning a budget or breaker on again with the settings of one made behind the one
// turned off (a rollback to the settings of a version before the one that had it) takes over
// from the one turned off; it does not take back the one behind it, which defers to it.

/// v1's budget (`with_budget`, 20 a window) is turned off by v2; a call of v0
/// (`with_other_budget`, 40 a window) that read the policies before v1 reaches the endpoint
/// after v2 and gets one made behind v1's. v3 rolls back to v0's settings: the endpoint's
/// budget takes over from v1's and allows the 40 v3 sets, not v1's 20 (taken back, the one
/// behind v1's held the new calls to v1's settings while a v1 or v2 call ran).
#[test]
fn a_budget_turned_on_again_with_a_straggler_s_settings_is_held_to_those_settings() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    let straggler = v2.behind(&with_other_budget());
    let v3 = v2.carry(&with_other_budget(), ms(t0, 200));
    // The same push on a state where no straggler came: 30 of 30.
    let w1 = EndpointState::new(&with_budget(), t0);
    let w3 = w1
        .carry(&without_budget(), ms(t0, 100))
        .carry(&with_other_budget(), ms(t0, 200));
    assert_eq!(retries_sent(t0, 300, std::iter::repeat_n(&w3, 30)), 30);
    let sent = retries_sent(t0, 300, std::iter::repeat_n(&v3, 30));
    assert_eq!(
        sent, 30,
        "{sent} of 30 retries under v3's budget of 40 a window, nothing spent before"
    );
    drop((v1, v2, straggler));
}

/// The same for a breaker: v1's breaker (`min_requests: 10`) is turned off by v2, a v0 call
/// (`min_requests: 5`) gets one behind it, and v3 rolls back to v0's settings. The endpoint's
/// breaker, once open, sends its probes half-open (taken back, the one behind v1's sent none,
/// probes being the newest of the line's alone, v1's, which no new call used: every call of
/// v3 was refused while a call of v1 or v2 ran).
#[test]
fn a_breaker_turned_on_again_with_a_straggler_s_settings_lets_probes_through_half_open() {
    let t0 = Instant::now();
    let with = |b: Option<BreakerConfig>| RetryPolicy {
        budget: None,
        circuit_breaker: b,
        ..RetryPolicy::default()
    };
    let a = BreakerConfig {
        min_requests: 10,
        ..BreakerConfig::default()
    };
    let a0 = BreakerConfig {
        min_requests: 5,
        ..BreakerConfig::default()
    };
    let v1 = EndpointState::new(&with(Some(a)), t0);
    let v2 = v1.carry(&with(None), ms(t0, 100));
    let straggler = v2.behind(&with(Some(a0.clone())));
    let v3 = v2.carry(&with(Some(a0)), ms(t0, 200));
    let breaker = v3.breaker().unwrap();
    for i in 0..10 {
        let now = ms(t0, 300 + i);
        if let Ok(permit) = breaker.try_acquire(now) {
            breaker.record(permit, false, now);
        }
    }
    assert_eq!(breaker.state(ms(t0, 400)), BreakerState::Open);
    // 30 s open: half-open from 30.31 s on. A probe goes out at once, or a minute on.
    let probed = [31_000, 60_000, 90_000]
        .iter()
        .any(|&at| breaker.try_acquire(ms(t0, at)).is_ok());
    assert!(
        probed,
        "the endpoint's breaker, half-open for a minute, let no probe through: every call \
         refused while a call of v1 or v2 holds v1's breaker"
    );
    drop((v1, v2, straggler));
}

/// After the rollback above, v4 turns the budget off again and v5 turns it on with v1's
/// settings: what v1's calls spent in this window is in v5's budget (a spent budget stays
/// spent). With the one behind v1's taken back at v3, v5 took over from it, which counted
/// nothing (its calls counted in v1's).
#[test]
fn a_budget_taking_over_from_a_superseded_one_turned_off_keeps_what_the_line_spent() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    let straggler = v2.behind(&with_other_budget());
    let v3 = v2.carry(&with_other_budget(), ms(t0, 200));
    // v1's calls in flight spend what the endpoint's budget (v3's, 40 a window) allows them.
    let spent = retries_sent(t0, 300, std::iter::repeat_n(&v1, 30));
    assert!(spent >= 20, "{spent}");
    let v4 = v3.carry(&without_budget(), ms(t0, 400));
    let v5 = v4.carry(&with_budget(), ms(t0, 500));
    let sent = retries_sent(t0, 600, std::iter::repeat_n(&v5, 30));
    assert_eq!(
        sent, 0,
        "{sent} retries handed out by v5's budget of 20 a window, v1's calls having spent \
         {spent} in this window (a spent budget stays spent)"
    );
    drop((v1, v2, v3, straggler));
}

/// The other half of the above: once v5's calls spent their 20, the calls still on v1 get
/// none in the same window: their budget is superseded, and they withdraw in the newest
/// (with the one behind v1's taken back at v3, v1's was never superseded and decided beside
/// v5's).
#[test]
fn after_taking_over_from_a_superseded_one_the_first_budget_does_not_decide_beside_it() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    let straggler = v2.behind(&with_other_budget());
    let v3 = v2.carry(&with_other_budget(), ms(t0, 200));
    let v4 = v3.carry(&without_budget(), ms(t0, 400));
    let v5 = v4.carry(&with_budget(), ms(t0, 500));
    assert_eq!(retries_sent(t0, 600, std::iter::repeat_n(&v5, 30)), 20);
    let sent = retries_sent(t0, 700, std::iter::repeat_n(&v1, 30));
    assert_eq!(
        sent, 0,
        "{sent} retries by the calls still on v1 after v5's budget, the endpoint's newest, \
         spent its 20 in this window"
    );
    drop((v2, v3, straggler));
}

/// Pruning the one turned off without asking about its line loses nothing
/// while the calls behind count in it. v1's budget is turned off and v1's state is gone; the
/// older version's calls behind v2 spend v1's 20 through the one made behind it; a pruning
/// look inside the window keeps v1's (it counts them), so the next such call is refused.
#[test]
fn pruning_keeps_the_one_turned_off_while_the_calls_behind_it_count_in_it() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    drop(v1);
    let behind: Vec<EndpointState> = (0..30).map(|_| v2.behind(&with_other_budget())).collect();
    assert_eq!(retries_sent(t0, 200, behind.iter()), 20);
    drop(behind);
    assert!(!v2.is_idle(ms(t0, 5_000)), "v1's budget counts 20 retries");
    let late = v2.behind(&with_other_budget());
    assert_eq!(retries_sent(t0, 5_100, std::iter::once(&late)), 0);
}

// The one turned off, when nothing holds it and it counts nothing, while two made behind it
// are still held.

/// A tight budget: 1 retry per second (10 per 10 s window).
fn with_tight_budget() -> RetryPolicy {
    RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 1,
            window: Duration::from_secs(10),
        }),
        circuit_breaker: None,
        ..RetryPolicy::default()
    }
}

/// v1's budget is turned off by v2; calls of two older versions (`with_other_budget`, 40 a
/// window, then `with_tight_budget`, 10 a window) reach the endpoint after v2 and get one
/// budget each, made behind v1's. v1's counts nothing and nothing else holds it, but the two
/// made behind it are still held by their calls, so v3's push keeps it: v3 turns the budget
/// on with `with_other_budget`'s settings and takes over from v1's, allowing v3's 40 a
/// window. (Let go, v3 took the one made for those settings, then behind the tight one, the
/// newest live member of their line, and v3's calls were held to 10 a window.)
#[test]
fn a_budget_taken_from_those_made_behind_a_let_go_one_is_held_to_its_own_settings() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&with_budget(), t0);
    let v2 = v1.carry(&without_budget(), ms(t0, 100));
    drop(v1);
    let other = v2.behind(&with_other_budget());
    let tight = v2.behind(&with_tight_budget());
    // 20 s on: v1's budget counts nothing and only v2's strays hold it.
    let v3 = v2.carry(&with_other_budget(), ms(t0, 20_000));
    // The same push where only one older version's calls came: 30 of 30.
    let w1 = EndpointState::new(&with_budget(), t0);
    let w2 = w1.carry(&without_budget(), ms(t0, 100));
    drop(w1);
    let w_other = w2.behind(&with_other_budget());
    let w3 = w2.carry(&with_other_budget(), ms(t0, 20_000));
    assert_eq!(retries_sent(t0, 20_100, std::iter::repeat_n(&w3, 30)), 30);
    let sent = retries_sent(t0, 20_100, std::iter::repeat_n(&v3, 30));
    assert_eq!(
        sent, 30,
        "{sent} of 30 retries under v3's budget of 40 a window, nothing spent in it: v3's \
         budget defers to the one made for the tight older version's calls"
    );
    drop((v2, other, tight, w2, w_other));
}

/// The same for a breaker: v1's breaker (`min_requests: 10`) is turned off by v2, never
/// used; calls of two older versions (`min_requests: 5`, then `min_requests: 40`) get one
/// made behind it each, still held. v3's push keeps v1's (closed, nothing counted, but the
/// two behind it held) and turns the breaker on with the first older version's settings: the
/// endpoint's breaker takes over from v1's and ten failures of ten calls open it by v3's
/// settings, at five. (Let go, the one made for those settings, then behind the other,
/// counted v3's failures by `min_requests: 40` and stayed closed.)
#[test]
fn a_breaker_taken_from_those_made_behind_a_let_go_one_opens_by_its_own_settings() {
    let t0 = Instant::now();
    let with = |b: Option<BreakerConfig>| RetryPolicy {
        budget: None,
        circuit_breaker: b,
        ..RetryPolicy::default()
    };
    let cfg = |min_requests| BreakerConfig {
        min_requests,
        ..BreakerConfig::default()
    };
    let v1 = EndpointState::new(&with(Some(cfg(10))), t0);
    let v2 = v1.carry(&with(None), ms(t0, 100));
    drop(v1);
    let five = v2.behind(&with(Some(cfg(5))));
    let forty = v2.behind(&with(Some(cfg(40))));
    let v3 = v2.carry(&with(Some(cfg(5))), ms(t0, 20_000));
    let fail_ten = |breaker: &retryplane_policy::breaker::CircuitBreaker| {
        for i in 0..10 {
            let now = ms(t0, 20_100 + i);
            if let Ok(permit) = breaker.try_acquire(now) {
                breaker.record(permit, false, now);
            }
        }
    };
    // The same push where only the first older version's calls came: open.
    let w1 = EndpointState::new(&with(Some(cfg(10))), t0);
    let w2 = w1.carry(&with(None), ms(t0, 100));
    drop(w1);
    let w_five = w2.behind(&with(Some(cfg(5))));
    let w3 = w2.carry(&with(Some(cfg(5))), ms(t0, 20_000));
    fail_ten(w3.breaker().unwrap());
    assert_eq!(
        w3.breaker().unwrap().state(ms(t0, 20_200)),
        BreakerState::Open
    );
    let breaker = v3.breaker().unwrap();
    fail_ten(breaker);
    assert_eq!(
        breaker.state(ms(t0, 20_200)),
        BreakerState::Open,
        "ten failures of ten calls under v3's breaker, which opens at five: counted in the \
         one made for the other older version's calls (min_requests 40)"
    );
    drop((v2, five, forty, w2, w_five));
}

/// A seeded walk over one endpoint's states: pushes to one of four policies (the newest
/// state carried), older versions' calls behind the newest state, calls ending, a held
/// state's calls spending (and, when `prunes`, pruning as an agent's report does), time
/// passing. After every push `decides_alone` must hold of the newest state; at the end, with
/// every other state gone and an hour passed, the newest state must be let go. Returns the
/// traces of the runs that failed (all of them printed with `STRAGGLER_WALK_ALL` set).
struct Walk<D, S> {
    seed: u64,
    runs: usize,
    /// Index 0 is the policy with it off; 1 to 3 have it on (older versions' calls use those).
    policies: [RetryPolicy; 4],
    /// A push moves time on by 0, 1 or 2 of these.
    push_step_ms: u64,
    prunes: bool,
    /// Whether the newest state, just pushed to policy `p`, decides alone at the instant.
    decides_alone: D,
    /// A held state's calls spending at the instant.
    spend: S,
}

impl<D, S> Walk<D, S>
where
    D: Fn(&EndpointState, usize, Instant) -> bool,
    S: Fn(&EndpointState, Instant),
{
    fn failures(mut self) -> Vec<String> {
        let mut next = |n: u64| {
            self.seed = self
                .seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.seed >> 33) % n
        };
        let steps = if self.prunes { 6 } else { 5 };
        let mut failures = Vec::new();
        for run in 0..self.runs {
            let t0 = Instant::now();
            let mut t = 0u64;
            let first = next(4) as usize;
            let mut newest = EndpointState::new(&self.policies[first], t0);
            let mut held: Vec<EndpointState> = Vec::new();
            let mut trace = vec![format!("new {first}")];
            for _ in 0..20 {
                match next(steps) {
                    0 | 1 => {
                        let p = next(4) as usize;
                        t += next(3) * self.push_step_ms;
                        trace.push(format!("t={t} push {p}"));
                        let n = newest.carry(&self.policies[p], ms(t0, t));
                        held.push(std::mem::replace(&mut newest, n));
                        if !(self.decides_alone)(&newest, p, ms(t0, t + 1)) {
                            failures.push(format!("run {run}: {}", trace.join(", ")));
                            break;
                        }
                    }
                    2 => {
                        let p = 1 + next(3) as usize;
                        trace.push(format!("t={t} behind {p}"));
                        held.push(newest.behind(&self.policies[p]));
                    }
                    3 if !held.is_empty() => {
                        let i = next(held.len() as u64) as usize;
                        trace.push(format!("t={t} drop #{i}"));
                        held.remove(i);
                    }
                    4 if self.prunes => {
                        trace.push(format!("t={t} prune"));
                        newest.is_idle(ms(t0, t));
                    }
                    _ if !held.is_empty() => {
                        let i = next(held.len() as u64) as usize;
                        trace.push(format!("t={t} use #{i}"));
                        (self.spend)(&held[i], ms(t0, t));
                    }
                    _ => {}
                }
            }
            held.clear();
            if !newest.is_idle(ms(t0, t + 3_600_000)) {
                failures.push(format!("run {run} (not let go): {}", trace.join(", ")));
            }
        }
        if std::env::var_os("STRAGGLER_WALK_ALL").is_some() {
            failures.iter().for_each(|f| eprintln!("{f}"));
        }
        failures
    }
}

/// The walk's verdict over `runs` runs.
fn assert_no_failures(failures: &[String], runs: usize) {
    assert!(
        failures.is_empty(),
        "{} runs of {runs} failed; the first: {}",
        failures.len(),
        failures.first().map_or("", String::as_str)
    );
}

/// Pushes turning the budget on, off, or to other settings, older versions' calls behind the
/// newest state, calls ending, and time passing (pruning between), from a fixed seed: after
/// every push, the newest state's budget decides for itself (a retry it allows is counted in
/// it, not in another budget it defers to); at the end, with every other state gone and an
/// hour passed, the newest state is let go.
#[test]
fn pushes_stragglers_and_pruning_leave_the_newest_budget_deciding_alone() {
    const RUNS: usize = 3000;
    let policy = |budget: Option<BudgetConfig>| RetryPolicy {
        budget,
        ..with_budget()
    };
    let failures = Walk {
        seed: 0x5eed_0087,
        runs: RUNS,
        policies: [
            policy(None),
            with_budget(),
            policy(with_other_budget().budget),
            policy(with_tight_budget().budget),
        ],
        push_step_ms: 12_000,
        prunes: false,
        decides_alone: |newest: &EndpointState, _: usize, now| {
            newest.budget().is_none_or(|b| {
                let before = b.snapshot(now).retries;
                !b.try_withdraw(now) || b.snapshot(now).retries == before + 1
            })
        },
        spend: |held: &EndpointState, now| {
            if let Some(b) = held.budget() {
                b.deposit(now);
                b.try_withdraw(now);
            }
        },
    }
    .failures();
    assert_no_failures(&failures, RUNS);
}

/// The walk for breakers: pushes turning the breaker on, off, or to other `min_requests` (5,
/// 10, 40), older versions' calls behind the newest state, calls failing through a held
/// state's breaker, calls ending, time passing, and pruning (`is_idle` on the newest state, as
/// an agent's report does) between, from a fixed seed: after every push, the newest state's
/// breaker opens by its own settings (its `min_requests` failures, every attempt in the window
/// a failure, open it: a breaker counting in another of the line, with another
/// `min_requests`, stays closed); at the end, with every other state gone and an hour passed,
/// the newest state is let go. (With `Kept::prune` letting the one turned off go before those
/// made behind it, as before d56f585, 13 of the 30000 runs fail.)
#[test]
fn pushes_stragglers_and_pruning_leave_the_newest_breaker_deciding_alone() {
    use retryplane_policy::breaker::CircuitBreaker;
    const RUNS: usize = 30000;
    let policy = |min_requests: Option<u32>| RetryPolicy {
        budget: None,
        circuit_breaker: min_requests.map(|min_requests| BreakerConfig {
            min_requests,
            ..BreakerConfig::default()
        }),
        ..RetryPolicy::default()
    };
    let fail = |b: &CircuitBreaker, n: u32, now: Instant| {
        for _ in 0..n {
            if let Ok(permit) = b.try_acquire(now) {
                b.record(permit, false, now);
            }
        }
    };
    let min_requests = [None, Some(5), Some(10), Some(40)];
    let failures = Walk {
        seed: 0x5eed_0088,
        runs: RUNS,
        policies: min_requests.map(policy),
        push_step_ms: 70_000,
        prunes: true,
        decides_alone: |newest: &EndpointState, p: usize, now| match (
            newest.breaker(),
            min_requests[p],
        ) {
            (Some(b), Some(n)) => {
                fail(b, n, now);
                b.state(now) == BreakerState::Open
            }
            _ => true,
        },
        spend: |held: &EndpointState, now| {
            if let Some(b) = held.breaker() {
                fail(b, 1, now);
            }
        },
    }
    .failures();
    assert_no_failures(&failures, RUNS);
}
