//! `retryplane validate FILE...`: every problem of every file, in the format CI greps (SPEC §5).
//!
//! Text (the default): stdout holds exactly one line per problem,
//! `FILE:LINE:COLUMN: error|warning: FIELD.PATH: message`, files in the order given, problems
//! in file order; nothing else. Stderr gets one summary line per file
//! (`FILE: valid (0 warnings)`, `FILE: invalid (3 errors, 1 warning)`) and the I/O errors.
//!
//! JSON (`--format json`): stdout is one array of `{file, line, column, severity, path, message}`
//! over all files, `[]` when clean; stderr only gets I/O errors.
//!
//! Every file is checked even after one fails. Exit code: `2` if any file could not be read
//! (even when another is invalid: the run did not check all it was asked to), else `1` if any
//! file has errors (or warnings, with `--deny-warnings`), else `0`.

use std::path::PathBuf;

use anyhow::bail;
use retryplane_policy::Diagnostic;

use crate::input::Source;
use crate::output::{self, Format, JsonDiagnostic};
use crate::{Outcome, Report};

/// `retryplane validate` flags, as parsed.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Policy files to check; `-` reads standard input.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "output")]
    format: Format,
    /// Fail (exit 1) on warnings too.
    #[arg(long)]
    deny_warnings: bool,
}

/// What to validate, checked once.
#[derive(Debug)]
pub struct Settings {
    /// Files in the order given; stdin at most once.
    pub sources: Vec<Source>,
    /// Output format.
    pub format: Format,
    /// Whether warnings fail the run.
    pub deny_warnings: bool,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        let sources: Vec<Source> = args.files.into_iter().map(Source::from_arg).collect();
        if sources.iter().filter(|s| **s == Source::Stdin).count() > 1 {
            bail!("`-` (standard input) can be given only once");
        }
        Ok(Self {
            sources,
            format: args.format,
            deny_warnings: args.deny_warnings,
        })
    }
}

/// The diagnostics of one file that could be read.
struct Checked {
    file: String,
    diagnostics: Vec<Diagnostic>,
}

/// Checks every file; see the module docs for what is printed and the exit code.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    let mut outcome = Outcome::Success;
    let mut checked = Vec::with_capacity(settings.sources.len());
    for source in &settings.sources {
        let loaded = match source.load_for_agents() {
            Ok(loaded) => loaded,
            Err(e) => {
                output::error(format_args!(
                    "{}",
                    retryplane_server::ErrorChain(e.as_ref())
                ));
                outcome = outcome.worst(Outcome::Error);
                continue;
            }
        };
        let file = source.to_string();
        // Those listed, and those the closing line of a long list says were left out.
        let (errors, warnings) = retryplane_policy::diag::counts(&loaded.diagnostics);
        let fails = errors > 0 || (settings.deny_warnings && warnings > 0);
        if fails {
            outcome = outcome.worst(Outcome::Failure);
        }
        if settings.format == Format::Text {
            output::note(format_args!(
                "{file}: {}",
                summary(fails, errors, warnings, settings.deny_warnings)
            ));
        }
        checked.push(Checked {
            file,
            diagnostics: loaded.diagnostics,
        });
    }
    let stdout = match settings.format {
        Format::Text => {
            let mut out = String::new();
            for c in &checked {
                for d in &c.diagnostics {
                    output::push_diagnostic_line(&mut out, &c.file, d);
                }
            }
            out
        }
        Format::Json => {
            let all: Vec<JsonDiagnostic<'_>> = checked
                .iter()
                .flat_map(|c| {
                    c.diagnostics
                        .iter()
                        .map(|d| JsonDiagnostic::new(&c.file, d))
                })
                .collect();
            output::json(&all)?
        }
    };
    Ok(Report { stdout, outcome })
}

/// `valid (1 warning)`, `invalid (2 errors, 0 warnings)`, `invalid (0 errors, 1 warning denied)`.
fn summary(fails: bool, errors: usize, warnings: usize, deny: bool) -> String {
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    let warnings_text = plural(warnings, "warning");
    if !fails {
        return format!("valid ({warnings_text})");
    }
    let denied = if deny && warnings > 0 { " denied" } else { "" };
    format!(
        "invalid ({}, {warnings_text}{denied})",
        plural(errors, "error")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_count_errors_and_warnings() {
        assert_eq!(summary(false, 0, 0, false), "valid (0 warnings)");
        assert_eq!(summary(false, 0, 1, false), "valid (1 warning)");
        assert_eq!(summary(true, 3, 1, false), "invalid (3 errors, 1 warning)");
        assert_eq!(
            summary(true, 0, 2, true),
            "invalid (0 errors, 2 warnings denied)"
        );
    }

    #[test]
    fn stdin_may_be_named_once_only() {
        let args = Args {
            files: vec!["-".into(), "a.yaml".into(), "-".into()],
            format: Format::Text,
            deny_warnings: false,
        };
        assert!(Settings::try_from(args).is_err());
    }
}
