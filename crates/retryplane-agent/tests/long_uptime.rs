//! An agent's endpoint with the shortest windows (1 ms: slots of 100 µs, whose
//! 32-bit epochs wrap every 4.97 days) after weeks of uptime on tokio's paused clock.

use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, Cause, GiveUpCause};

const POLICY: &str = "version: 1
endpoints:
  a:
    max_attempts: 1
    deadline: 1s
    per_try_timeout: 1s
    budget: {ratio: 0.5, min_per_second: 1000, window: 1ms}
    circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 1ms, open_for: 5ms, half_open_probes: 1}
";

async fn fail(ep: &retryplane_agent::Endpoint) -> Result<(), Cause> {
    ep.call(CallMeta::http("GET", "/"), |_| async {
        Err::<http::Response<()>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    })
    .await
    .map(|_| ())
    .map_err(|e| e.cause)
}

async fn succeed(ep: &retryplane_agent::Endpoint) -> Result<(), Cause> {
    ep.call(CallMeta::http("GET", "/"), |_| async {
        Ok::<_, std::io::Error>(http::Response::new(()))
    })
    .await
    .map(|_| ())
    .map_err(|e| e.cause)
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_and_closes_at_every_age_over_sixty_days() {
    let set = retryplane_agent::policy::load(POLICY.as_bytes())
        .policies
        .unwrap();
    let agent = Agent::from_policies_seeded(set, 7);
    let ep = agent.endpoint("a");
    let day = Duration::from_secs(86_400);
    // Jumps of about a day (some just short of, some just past the epoch wrap), up to 60 days.
    let jumps = [
        day,
        Duration::from_nanos((1u64 << 32) * 100_000 - 3_000_000),
        Duration::from_nanos((1u64 << 32) * 100_000 + 7_000_000),
        Duration::from_nanos((1u64 << 29) * 100_000),
        day * 3,
    ];
    let mut elapsed = Duration::ZERO;
    let mut rounds = 0;
    while elapsed < day * 60 {
        let jump = jumps[rounds % jumps.len()];
        tokio::time::advance(jump).await;
        elapsed += jump;
        rounds += 1;
        for _ in 0..4 {
            assert_eq!(
                fail(&ep).await,
                Err(Cause::GaveUp(GiveUpCause::AttemptsExhausted)),
                "round {rounds}"
            );
        }
        assert_eq!(
            succeed(&ep).await,
            Err(Cause::GaveUp(GiveUpCause::CircuitOpen)),
            "round {rounds} ({:.2} days): four failures did not open the breaker",
            elapsed.as_secs_f64() / 86_400.0
        );
        tokio::time::advance(Duration::from_millis(6)).await;
        elapsed += Duration::from_millis(6);
        assert_eq!(succeed(&ep).await, Ok(()), "round {rounds}: the probe");
        assert_eq!(succeed(&ep).await, Ok(()), "round {rounds}: closed again");
    }
    assert!(rounds > 20, "{rounds}");
    eprintln!(
        "{rounds} rounds over {:.1} days",
        elapsed.as_secs_f64() / 86_400.0
    );
}
