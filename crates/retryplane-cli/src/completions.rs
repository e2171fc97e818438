//! `retryplane completions SHELL`: the shell's completion script for every command and flag,
//! printed on stdout, made by `clap_complete` from the same definition the parser uses (so it
//! cannot fall behind a new flag). Install it as the shell expects, for example:
//!
//! ```text
//! retryplane completions bash > ~/.local/share/bash-completion/completions/retryplane
//! retryplane completions zsh > "${fpath[1]}/_retryplane"
//! retryplane completions fish > ~/.config/fish/completions/retryplane.fish
//! ```

use clap::builder::ValueHint;
use clap::{Command, CommandFactory};
use clap_complete::Shell;

use crate::{Cli, Outcome, Report};

/// `retryplane completions` flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to write the completion script for.
    #[arg(value_enum)]
    shell: Shell,
}

/// The completion script of `args.shell`.
pub fn run(args: &Args) -> Report {
    let mut command = hinted(Cli::command());
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "retryplane", &mut script);
    if args.shell == Shell::Fish {
        script.extend_from_slice(fish_positional_values(&command).as_bytes());
    }
    Report {
        // clap_complete writes the script's own text, which is UTF-8; a lossy read keeps any
        // byte it might not be.
        stdout: String::from_utf8_lossy(&script).into_owned(),
        outcome: Outcome::Success,
    }
}

/// Fish completions of the commands' positional values that have possible values (`completions
/// SHELL`): clap_complete's fish script completes flags and commands only, so fish offered
/// file names there. Written here as clap_complete writes its own lines. File names are left
/// out only where every positional value of the command has possible values.
fn fish_positional_values(cmd: &Command) -> String {
    let mut lines = String::new();
    for sub in cmd.get_subcommands() {
        let positionals: Vec<_> = sub.get_positionals().collect();
        let all_listed = positionals
            .iter()
            .all(|arg| !arg.get_possible_values().is_empty());
        for arg in positionals {
            let values: Vec<String> = arg
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| v.get_name().to_owned())
                .collect();
            if values.is_empty() {
                continue;
            }
            lines.push_str(&format!(
                "complete -c {} -n \"__fish_{}_using_subcommand {}\"{} -a \"{}\"\n",
                cmd.get_name(),
                cmd.get_name(),
                sub.get_name(),
                if all_listed { " -f" } else { "" },
                values.join(" ")
            ));
        }
    }
    lines
}

/// `cmd` with a value hint on every flag whose value is no path (a version, a URL, a token):
/// without one, the shells offer file names for it. A value named `FILE` or `DIR` is a path; a
/// flag with possible values or a path type has its hint already.
fn hinted(cmd: Command) -> Command {
    cmd.mut_args(|arg| {
        if !arg.get_action().takes_values() || !arg.get_possible_values().is_empty() {
            return arg;
        }
        let named = |name: &str| {
            arg.get_value_names()
                .is_some_and(|names| names.iter().any(|n| n.as_str() == name))
        };
        // By the value's name first: a `PathBuf` flag is hinted "any path" by clap already.
        let hint = if named("FILE") {
            ValueHint::FilePath
        } else if named("DIR") {
            ValueHint::DirPath
        } else if arg.get_value_hint() == ValueHint::Unknown {
            ValueHint::Other
        } else {
            return arg;
        };
        arg.value_hint(hint)
    })
    .mut_subcommands(hinted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(shell: Shell) -> String {
        run(&Args { shell }).stdout
    }

    /// Fish completes `completions`' one value with the shells' names, not with file names
    /// (clap_complete's fish script leaves positional values out).
    #[test]
    fn fish_completes_the_shells_after_completions() {
        let text = script(Shell::Fish);
        assert!(
            text.contains(
                "complete -c retryplane -n \"__fish_retryplane_using_subcommand completions\" -f \
                 -a \"bash elvish fish powershell zsh\"\n"
            ),
            "{text}"
        );
        // The condition is the one clap_complete defines.
        assert!(text.contains("function __fish_retryplane_using_subcommand"));
    }

    /// Every command and a flag of each kind are in each shell's script.
    #[test]
    fn every_shells_script_names_the_commands_and_their_flags() {
        for shell in [
            Shell::Bash,
            Shell::Zsh,
            Shell::Fish,
            Shell::Elvish,
            Shell::PowerShell,
        ] {
            let text = script(shell);
            for word in [
                "validate",
                "explain",
                "apply",
                "rollback",
                "simulate",
                "request",
                "completions",
                // Fish writes a long flag as `-l NAME`.
                "expected-version",
                "deny-warnings",
            ] {
                assert!(text.contains(word), "{shell:?} lacks {word}");
            }
        }
    }
}
