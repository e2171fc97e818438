//! The last metrics report at shutdown, when its counts are too large for one report (over
//! 1 MiB: it goes out in several parts) and the stream's queue frees one slot at a time (the
//! messages ahead are each over tonic's 32 KiB yield threshold, so the HTTP/2 body takes one
//! per poll), against a raw HTTP/2 control plane (`support::raw`) that opens its window when
//! the test says and gives back none of what it read until then. Every part waits for room
//! within the close grace (room was once awaited for one message only: the second part went
//! back into the counters, with no later stream to take it), and what found room gets the
//! half-close's own grace, even when a later part found none.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use retryplane_agent::{Agent, CallMeta};
use retryplane_proto::pb::agent_message::Kind;
use support::raw::{Opening, RawPlane, answers, calls, push, received_until, shut_down_while};
use tokio::time::Instant;

/// Every call the tests make: 400 + 400 + 12,000.
const ALL_CALLS: u64 = 12_800;

/// One successful call on each of `names`.
async fn call_each(agent: &Agent, names: impl Iterator<Item = String>) {
    for name in names {
        agent
            .endpoint(&name)
            .call(
                CallMeta::http("GET", "/"),
                support::Upstream::new([]).attempt(),
            )
            .await
            .unwrap();
    }
}

/// `count` long endpoint names starting with `group`.
fn names(group: char, count: usize) -> impl Iterator<Item = String> {
    (0..count).map(move |i| format!("{group}-{i:0>110}"))
}

/// A control plane (reports every 300 ms; numbered when `acks`) whose window is shut, and an
/// agent on it with, queued: two periodic reports of 400 endpoints each (over 32 KiB: one held
/// by HTTP/2, one at the head of the queue) and the ACKs of `pushes` snapshots; then 12,000
/// endpoints counted (the last report: 2 parts), or none without the reports.
async fn staged(
    acks: bool,
    pushes: u64,
    reports: bool,
) -> (RawPlane, Agent, h2::SendStream<Bytes>) {
    let mut plane = RawPlane::start(Opening {
        interval_ms: 300,
        acks,
        held: true,
        ..Opening::default()
    })
    .await;
    let agent = support::plane::agent(plane.addr, "a", None);
    let mut send = plane.stream().await;
    if reports {
        // Each goes out at its report, 300 ms after the calls.
        call_each(&agent, names('a', 400)).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        call_each(&agent, names('b', 400)).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    push(&agent, &mut send, 1..=pushes).await;
    call_each(&agent, names('c', 12_000)).await;
    (plane, agent, send)
}

/// At `slot` after `started`, a window for about 1.5 of the 400-endpoint reports (one slot of
/// the queue frees); at `all`, everything read is given back and the window opened wide.
async fn one_slot_then_all(plane: &RawPlane, started: Instant, slot: Duration, all: Duration) {
    tokio::time::sleep_until(started + slot).await;
    plane.set_window(70_000);
    tokio::time::sleep_until(started + all).await;
    plane.release();
    plane.set_window(64 << 20);
}

/// Part 1 of the last report finds room at 1.2 s (one slot frees), its last part none within
/// the close grace (2 s; the window opens wide at 2.5 s); what found room (the reports and ACKs
/// queued before, and part 1) gets the half-close's own grace, until 3.2 s, and reaches the
/// control plane. (With part 1's room at 300 ms, the window opened at 2.3 s and the grace
/// ended about then: on a loaded machine part 1 was once cut off within it.)
async fn what_found_room_is_not_cut_off(acks: bool) {
    let (mut plane, agent, _send) = staged(acks, 15, true).await;
    let started = Instant::now();
    let took = shut_down_while(
        &agent,
        one_slot_then_all(
            &plane,
            started,
            Duration::from_millis(1_200),
            Duration::from_millis(2_500),
        ),
    )
    .await;
    let got = received_until(&mut plane.msgs, |got| calls_of(got, 'c') > 0).await;
    let (a, b, c) = (
        calls_of(&got, 'a'),
        calls_of(&got, 'b'),
        calls_of(&got, 'c'),
    );
    let summary = format!("calls a/b/c {a}/{b}/{c}; shutdown took {took:?}");
    assert_eq!(
        (a, b),
        (400, 400),
        "the reports queued before shutdown: {summary}"
    );
    assert!(
        c > 0,
        "part 1 of the last report, queued within the grace: {summary}"
    );
    assert_eq!(
        answers(&got).last(),
        Some(&("ack", 15)),
        "the ACKs queued before shutdown: {summary}"
    );
}

/// The calls on endpoints of `group` among the reports in `kinds`.
fn calls_of(kinds: &[Kind], group: char) -> u64 {
    kinds
        .iter()
        .filter_map(|k| match k {
            Kind::Metrics(r) => Some(r),
            _ => None,
        })
        .flat_map(|r| &r.endpoints)
        .filter(|e| e.endpoint.starts_with(group))
        .map(|e| e.calls)
        .sum()
}

/// Unnumbered stream (a control plane that does not acknowledge reports).
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_part_that_found_room_is_not_cut_off_unnumbered() {
    what_found_room_is_not_cut_off(false).await;
}

/// Numbered stream (reports kept until acknowledged).
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_part_that_found_room_is_not_cut_off_numbered() {
    what_found_room_is_not_cut_off(true).await;
}

/// The window opens for one slot at 300 ms, wide at 800 ms: every call reaches the control
/// plane.
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_in_two_parts_is_not_cut_in_half_at_shutdown() {
    let (mut plane, agent, _send) = staged(false, 15, true).await;
    let started = Instant::now();
    let took = shut_down_while(
        &agent,
        one_slot_then_all(
            &plane,
            started,
            Duration::from_millis(300),
            Duration::from_millis(800),
        ),
    )
    .await;
    let got = received_until(&mut plane.msgs, |got| calls(got) >= ALL_CALLS).await;
    assert_eq!(calls(&got), ALL_CALLS, "shutdown took {took:?}");
}

/// The last report's counts are all taken at once, as shutdown begins, under v15; its parts are
/// filled in one at a time, each as it finds room. Policies set meanwhile (`Agent::set_policies`,
/// version 0) do not label the second part: its counts were made under v15. (They once did.)
#[tokio::test(flavor = "current_thread")]
async fn every_part_of_the_last_report_carries_the_version_its_counts_were_made_under() {
    let (mut plane, agent, _send) = staged(true, 15, true).await;
    let started = Instant::now();
    shut_down_while(&agent, async {
        tokio::time::sleep_until(started + Duration::from_millis(300)).await;
        plane.set_window(70_000);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Part 1 is queued, part 2 waits for room.
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  z: {}\n")
            .policies
            .unwrap();
        agent.set_policies(set);
        one_slot_then_all(
            &plane,
            started,
            Duration::from_millis(300),
            Duration::from_millis(800),
        )
        .await;
    })
    .await;
    let got = received_until(&mut plane.msgs, |got| calls(got) >= ALL_CALLS).await;
    assert_eq!(calls(&got), ALL_CALLS, "every call arrives");
    let last: Vec<(u64, u64)> = got
        .iter()
        .filter_map(|k| match k {
            Kind::Metrics(r) if r.endpoints.iter().any(|e| e.endpoint.starts_with('c')) => {
                Some((r.seq, r.policy_version))
            }
            _ => None,
        })
        .collect();
    assert!(last.len() >= 2, "in parts: {last:?}");
    assert!(
        last.iter().all(|&(_, v)| v == 15),
        "(seq, policy_version) of the last report's parts: {last:?}"
    );
}

/// A control plane that takes nothing: the last report in two parts, the queue full of ACKs:
/// shutdown is held up one grace (2 s), not more.
#[tokio::test(flavor = "current_thread")]
async fn a_stuck_control_plane_holds_a_split_last_report_one_grace() {
    let (_plane, agent, _send) = staged(true, 17, false).await;
    let took = shut_down_while(&agent, async {}).await;
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_500),
        "{took:?}"
    );
}

/// Slow but reading: one slot at 300 ms, everything read from 1.5 s into the shutdown (part 2
/// finds room late in the grace); the control plane never closes its side. Every call arrives,
/// and shutdown is held up a grace from that room (3.5 s), under two graces (4 s). (The grace
/// once counted from the end of the close's own wait: part 2's room ends that wait here, so
/// `a_stuck_control_plane_with_one_slot_free_holds_a_split_last_report_one_grace` is the test
/// of that.)
#[tokio::test(flavor = "current_thread")]
async fn a_split_last_report_that_finds_room_late_holds_shutdown_two_graces_at_most() {
    let (mut plane, agent, _send) = staged(true, 15, true).await;
    let started = Instant::now();
    let took = shut_down_while(
        &agent,
        one_slot_then_all(
            &plane,
            started,
            Duration::from_millis(300),
            Duration::from_millis(1_500),
        ),
    )
    .await;
    let got = received_until(&mut plane.msgs, |got| calls(got) >= ALL_CALLS).await;
    assert_eq!(calls(&got), ALL_CALLS);
    assert!(took < Duration::from_millis(4_000), "{took:?}");
}

/// A control plane that takes nothing, as in
/// `a_stuck_control_plane_holds_a_split_last_report_one_grace`, but with one slot of the queue
/// free at shutdown (16 pushes, not 17): part 1 of the last report takes that slot at once,
/// part 2 waits the whole grace for room and finds none. The half-close's grace counts from
/// part 1's room, so shutdown is held one grace, not two (it once counted from the end of the
/// close's own wait: 4 s for a control plane that read nothing).
#[tokio::test(flavor = "current_thread")]
async fn a_stuck_control_plane_with_one_slot_free_holds_a_split_last_report_one_grace() {
    let (_plane, agent, _send) = staged(true, 16, false).await;
    let took = shut_down_while(&agent, async {}).await;
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_500),
        "{took:?}"
    );
}
