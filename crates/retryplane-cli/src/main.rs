//! `retryplane`: the command line of the retryplane retry-policy control plane (SPEC §5).
//!
//! - offline: `validate FILE...` reports every problem of every file as
//!   `FILE:LINE:COLUMN: error|warning: FIELD.PATH: message` (or one JSON array); `explain FILE
//!   --endpoint NAME [...]` shows the effective policy of one call, the layer each value came
//!   from, the retry schedule against the deadline and the worst-case load; `simulate --policy
//!   FILE --endpoint NAME [...]` runs a fleet of the policy's clients against an upstream that
//!   falls over, in virtual time, beside no budget, no jitter and a naive client;
//! - `request --policy FILE --endpoint NAME URL` makes one HTTP call under a policy and shows
//!   every attempt;
//! - the control plane: `serve` runs it; `apply`, `diff`, `get`, `history`, `rollback`,
//!   `status`, `stats` and `top` talk to its admin API (`--server`, `--token` /
//!   `RETRYPLANE_TOKEN`); `top` is the one command that keeps running: a live view, on the
//!   terminal's alternate screen when stdout is a terminal, plain text blocks otherwise;
//! - `completions SHELL` prints a shell's completion script.
//!
//! Each command is one [`Command`] variant and one module: clap parses raw flags (`Args`), the
//! module turns them into validated `Settings` once, and its `run` returns a [`Report`] — what
//! to print on stdout and the [`Outcome`]. Only `main` touches the process: it prints, and maps
//! the outcome to the exit code. `top` prints as it goes and returns an empty report.
//!
//! # Exit codes
//!
//! - `0` success (for `validate`: every file valid, warnings allowed unless `--deny-warnings`);
//! - `1` the input was read but fails (a policy with errors), or the server refused the request
//!   (invalid policy, version conflict, permission);
//! - `2` usage or I/O error: bad flags, a file that cannot be read, an unknown endpoint, a
//!   server that cannot be reached.
//!   When both happen in one run (one file unreadable, another invalid), `2` wins: the run did
//!   not check everything it was asked to.
//!
//! Two commands read them otherwise. `diff --exit-code`: `1` there means the file differs, so
//! an invalid file or a refusal exits `2` (it could not compare). `request` (SPEC §5): `1` the
//! call failed under the policy (a refused connect included), `2` usage or configuration (an
//! invalid policy file included). `serve` exits `2` when it cannot start, an invalid policy
//! file with an empty store included.
//!
//! The policy logic lives in `retryplane-policy` and the server in `retryplane-server`; this
//! crate reads files, calls them and renders their answers.

#![forbid(unsafe_code)]

mod admin;
mod completions;
mod explain;
mod flags;
mod input;
mod output;
mod request;
mod serve;
mod shown;
mod simulate;
mod validate;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Command-line arguments as clap parses them.
#[derive(Debug, Parser)]
#[command(
    name = "retryplane",
    version = retryplane_server::BUILD,
    about = "Validate, explain and operate retry policies",
    after_help = "Exit codes: 0 success, 1 invalid policy or refused by the server, 2 usage, I/O or connection error (2 wins over 1). With `diff --exit-code`: 1 it differs, 2 it could not be compared. With `request`: 1 the call failed under the policy, 2 usage or configuration (an invalid policy included). `serve`: 2 when it cannot start (an invalid policy file and an empty store included).",
    propagate_version = true
)]
struct Cli {
    /// The command to run.
    #[command(subcommand)]
    command: Command,
}

/// Every `retryplane` command: one variant and one module each.
#[derive(Debug, Subcommand)]
enum Command {
    /// Check policy files and report every problem with FILE:LINE:COLUMN and the field path.
    Validate(validate::Args),
    /// Show the effective policy of one call, its retry schedule and its worst-case load.
    Explain(explain::Args),
    /// Publish a policy file as the new version on the control plane (API mode).
    Apply(admin::apply::Args),
    /// Show what `apply FILE` would change on the control plane, changing nothing, or what
    /// changed between two stored versions (`--from N`).
    Diff(admin::diff::Args),
    /// Print the current (or a past) version from the control plane.
    Get(admin::get::Args),
    /// List the stored versions, newest first.
    History(admin::history::Args),
    /// Publish the content of a past version as a new version.
    Rollback(admin::rollback::Args),
    /// Show the connected agents, how far the fleet is on the current version, and the
    /// endpoints whose retry ratio is past its threshold.
    ///
    /// The summary line counts, for the current version: nacked, the agents whose last answer
    /// is a NACK of it, connected or not (a refusal stays in sight after its agent has gone);
    /// acked and pending, the other connected agents that run it and that do not yet;
    /// disconnected, the other agents the server still remembers.
    Status(admin::status::Args),
    /// Print the fleet's retry metrics per service and endpoint, and lifetime totals.
    #[command(after_help = admin::GIVE_UPS_HELP)]
    Stats(admin::stats::Args),
    /// A live view of the retry metrics, worst retry ratio first; q, Esc or Ctrl-C quits.
    ///
    /// On a terminal it redraws in place, and a refresh that fails is shown on the screen and
    /// tried again at the next interval. Otherwise (or with `--output json`) it prints a block
    /// (or a JSON line) per refresh: its first refresh must answer (else it exits as the other
    /// admin commands do), a later one that fails other than by a refusal (the server cannot be
    /// reached, or gives no answer within 30 s) is a warning on stderr and is tried again at
    /// the next interval, and a refusal ends it with exit 1.
    #[command(after_help = admin::GIVE_UPS_HELP)]
    Top(admin::top::Args),
    /// Run the control plane until SIGTERM or Ctrl-C.
    Serve(serve::Args),
    /// Simulate a policy's clients against an upstream that falls over (a retry storm),
    /// compared with no budget, no jitter and a naive client.
    ///
    /// The simulated calls are GET requests under the endpoint's own policy: its routes are
    /// not consulted.
    #[command(after_long_help = simulate::FIGURES)]
    Simulate(simulate::Args),
    /// Make one HTTP call under an endpoint's policy and show every attempt.
    #[command(
        after_help = "Causes of a failure (JSON `cause`): not_retryable, attempts_exhausted, budget_exhausted, deadline_exceeded, retry_after_too_long, circuit_open (SPEC §5); and cancelled when Ctrl-C stops the call. When the cause alone does not say why (a failure not retried for its method or not in retry_on, a hint over retry_after.max, a pause past the deadline), a line on stderr does. Exit codes: 0 success, 1 the call failed (cancelled included), 2 usage or configuration."
    )]
    Request(request::Args),
    /// Print the completion script of a shell (bash, zsh, fish, elvish, powershell).
    Completions(completions::Args),
}

/// How a command ended; each outcome is one exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0: everything checked and fine.
    Success,
    /// Exit 1: the input was read, and fails (a policy with errors, or warnings denied).
    Failure,
    /// Exit 2: a usage or I/O error.
    Error,
}

impl Outcome {
    /// The worse of two outcomes: `Error` over `Failure` over `Success`.
    #[must_use]
    pub fn worst(self, other: Outcome) -> Outcome {
        use Outcome::{Error, Failure, Success};
        match (self, other) {
            (Error, _) | (_, Error) => Error,
            (Failure, _) | (_, Failure) => Failure,
            (Success, Success) => Success,
        }
    }
}

impl From<Outcome> for ExitCode {
    fn from(outcome: Outcome) -> Self {
        ExitCode::from(match outcome {
            Outcome::Success => 0,
            Outcome::Failure => 1,
            Outcome::Error => 2,
        })
    }
}

/// What a command produced: its whole stdout, and how it ended.
#[derive(Debug)]
pub struct Report {
    /// Printed on stdout as is.
    pub stdout: String,
    /// The exit code.
    pub outcome: Outcome,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Usage errors go to stderr (exit 2); `--help` and `--version` to stdout (exit 0).
            // clap quotes a stray argument as given: a URL with a password is shown without.
            let args: Vec<String> = std::env::args_os()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            // A header is looked for only in an argument clap did not expect (an -H left
            // out): the value of another flag is never a header, and is shown as given.
            let headers = matches!(
                e.kind(),
                clap::error::ErrorKind::UnknownArgument | clap::error::ErrorKind::InvalidSubcommand
            );
            let text = shown::without_passwords(&e.render().ansi().to_string(), &args, headers);
            // Colour as clap would have it: kept on a terminal, stripped otherwise or with
            // NO_COLOR. A closed stream is ignored: there is nowhere left to write.
            let _ = if e.use_stderr() {
                write!(anstream::stderr(), "{text}")
            } else {
                write!(anstream::stdout(), "{text}")
            };
            return if e.use_stderr() {
                Outcome::Error
            } else {
                Outcome::Success
            }
            .into();
        }
    };
    let outcome = match run(cli) {
        Ok(report) => match output::stdout(&report.stdout) {
            Ok(()) => report.outcome,
            Err(e) => {
                output::error(format_args!("cannot write to stdout: {e}"));
                Outcome::Error
            }
        },
        Err(e) => {
            output::error(format_args!(
                "{}",
                retryplane_server::ErrorChain(e.as_ref())
            ));
            Outcome::Error
        }
    };
    outcome.into()
}

/// Runs the chosen command. An `Err` is a usage or I/O error (exit 2).
fn run(cli: Cli) -> anyhow::Result<Report> {
    match cli.command {
        Command::Validate(args) => validate::run(&args.try_into()?),
        Command::Explain(args) => explain::run(&args.try_into()?),
        Command::Apply(args) => admin::apply::run(&args.try_into()?),
        Command::Diff(args) => admin::diff::run(&args.try_into()?),
        Command::Get(args) => admin::get::run(&args.try_into()?),
        Command::History(args) => admin::history::run(&args.try_into()?),
        Command::Rollback(args) => admin::rollback::run(&args.try_into()?),
        Command::Status(args) => admin::status::run(&args.try_into()?),
        Command::Stats(args) => admin::stats::run(&args.try_into()?),
        Command::Top(args) => admin::top::run(&args.try_into()?),
        Command::Serve(args) => serve::run(args.into()),
        Command::Simulate(args) => simulate::run(&args.try_into()?),
        Command::Request(args) => request::run(&args.try_into()?),
        Command::Completions(args) => Ok(completions::run(&args)),
    }
}
