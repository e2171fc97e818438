//! Reading policy files: from a path or stdin, never more than the policy size limit.
//!
//! A file larger than [`MAX_FILE_BYTES`] is not read into memory: its size is checked from the
//! metadata when it is a regular file, and every read goes through `take(MAX + 1)`, so a 10 GB
//! file, `/dev/zero` or an endless pipe cost at most 1 MiB. An oversized file is a problem *of
//! the file* (an error diagnostic at 1:1, exit 1), like any other the policy crate reports; a
//! file that cannot be opened or read at all is an I/O error (exit 2).

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;

use anyhow::{Context, bail};
use retryplane_policy::yaml::Loc;
use retryplane_policy::yaml::MAX_FILE_BYTES;
use retryplane_policy::{Diagnostic, Loaded};

/// Where a policy file comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A path as given on the command line.
    Path(PathBuf),
    /// Standard input (`-` on the command line).
    Stdin,
}

impl Source {
    /// `-` is stdin, anything else a path.
    pub fn from_arg(arg: PathBuf) -> Self {
        if arg.as_os_str() == "-" {
            Source::Stdin
        } else {
            Source::Path(arg)
        }
    }

    /// Reads and loads the policy: its compiled set or its problems. `Err` only when the bytes
    /// cannot be read.
    pub fn load(&self) -> anyhow::Result<Loaded> {
        Ok(match self.read()? {
            Contents::Bytes(bytes) => retryplane_policy::load(&bytes),
            Contents::TooLarge(size) => retryplane_policy::too_large(size),
        })
    }

    /// [`Source::load`] of a file meant for a control plane (`validate`): it also gets the
    /// error the control plane would refuse it with when its snapshot could be too large for
    /// agents ([`fit_agents`]).
    pub fn load_for_agents(&self) -> anyhow::Result<Loaded> {
        let mut loaded = self.load()?;
        fit_agents(&mut loaded);
        Ok(loaded)
    }

    /// [`Source::load_for_agents`] with every diagnostic, uncut
    /// ([`retryplane_policy::load_all`]): for `explain`, which shows those of one endpoint.
    pub fn load_all_for_agents(&self) -> anyhow::Result<Loaded> {
        let mut loaded = match self.read()? {
            Contents::Bytes(bytes) => retryplane_policy::load_all(&bytes),
            Contents::TooLarge(size) => retryplane_policy::too_large(size),
        };
        fit_agents(&mut loaded);
        Ok(loaded)
    }

    /// Reads the raw bytes, at most [`MAX_FILE_BYTES`] (for sending them elsewhere, such as
    /// the admin API). `Err` only when the bytes cannot be read.
    pub fn read(&self) -> anyhow::Result<Contents> {
        match self {
            Source::Stdin => read_limited(io::stdin().lock(), None).context("cannot read stdin"),
            Source::Path(path) => {
                let cannot = || format!("cannot read {}", path.display());
                let file = File::open(path).with_context(cannot)?;
                let meta = file.metadata().with_context(cannot)?;
                if meta.is_dir() {
                    bail!("cannot read {}: it is a directory", path.display());
                }
                // Only a regular file's length is its size (a FIFO or device says 0).
                let size = meta.is_file().then_some(meta.len());
                if size.is_some_and(|len| len > MAX_BYTES) {
                    return Ok(Contents::TooLarge(size));
                }
                read_limited(file, size).with_context(cannot)
            }
        }
    }
}

/// The name printed before each diagnostic: the path as given, or `<stdin>`.
impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Path(path) => write!(f, "{}", path.display()),
            Source::Stdin => f.write_str("<stdin>"),
        }
    }
}

const MAX_BYTES: u64 = MAX_FILE_BYTES as u64;

/// Adds an error at 1:1 to `loaded`, and drops its compiled set, when its policies could make
/// a snapshot message longer than agents decode (`retryplane_proto::check_agent_limit`): the
/// control plane refuses such a change, so a file `validate` passes is one it takes. A policy
/// file is at most 1 MiB, so only aliases or anchors that repeat large parts get there.
pub fn fit_agents(loaded: &mut Loaded) {
    let Some(policies) = &loaded.policies else {
        return;
    };
    let document = retryplane_proto::pb::PolicyDocument::from(policies.document().as_ref());
    if let Err(e) = retryplane_proto::check_agent_limit(&document) {
        loaded.policies = None;
        loaded.diagnostics.insert(
            0,
            Diagnostic::error(Loc { line: 1, column: 1 }, "<root>", e.to_string()),
        );
    }
}

/// What reading found.
pub enum Contents {
    /// The whole input, at most [`MAX_FILE_BYTES`].
    Bytes(Vec<u8>),
    /// More than [`MAX_FILE_BYTES`]; the size when known.
    TooLarge(Option<u64>),
}

/// Reads at most one byte past the limit, enough to tell that the input is too large.
fn read_limited(reader: impl Read, size_hint: Option<u64>) -> io::Result<Contents> {
    let capacity = size_hint.map_or(8 * 1024, |len| len.min(MAX_BYTES + 1));
    let mut bytes = Vec::with_capacity(usize::try_from(capacity).unwrap_or(MAX_FILE_BYTES));
    reader.take(MAX_BYTES + 1).read_to_end(&mut bytes)?;
    Ok(if bytes.len() > MAX_FILE_BYTES {
        Contents::TooLarge(None)
    } else {
        Contents::Bytes(bytes)
    })
}

/// The error for an endpoint `name` that `source` (a file, or `the control plane at URL`)
/// does not define: the closest of its `names`, and all of them. The name asked for is shown
/// escaped, as typed characters: it comes from the command line and may hold anything.
pub fn no_such_endpoint(source: &str, name: &str, names: &[&str]) -> anyhow::Error {
    anyhow::anyhow!(
        "{source} defines no endpoint `{}`{}; its endpoints are: {}",
        name.escape_debug(),
        retryplane_policy::diag::did_you_mean(name, names.iter().copied()),
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_stops_one_byte_past_the_limit() {
        let endless = io::repeat(b'a');
        match read_limited(endless, None).unwrap() {
            Contents::TooLarge(None) => {}
            _ => panic!("an endless input must be too large"),
        }
        match read_limited(&b"version: 1"[..], Some(10)).unwrap() {
            Contents::Bytes(b) => assert_eq!(b, b"version: 1"),
            Contents::TooLarge(_) => panic!("a small input fits"),
        }
    }

    #[test]
    fn an_endpoint_not_defined_is_named_escaped_with_the_closest_and_all() {
        let names = ["payments", "search"];
        let e = no_such_endpoint("policies.yaml", "paymnts", &names).to_string();
        assert_eq!(
            e,
            "policies.yaml defines no endpoint `paymnts` (did you mean `payments`?); its \
             endpoints are: payments, search"
        );
        let e = no_such_endpoint("policies.yaml", "a\u{1b}[31mb", &names).to_string();
        assert!(e.contains("`a\\u{1b}[31mb`"), "{e}");
        assert!(!e.contains('\u{1b}'), "{e}");
    }
}
