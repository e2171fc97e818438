//! `retryplane get [--version N]`: the current (or a past) version.
//!
//! `--output yaml` (the default) prints it as a policy file, ready for `validate`, an edit and
//! `apply` (one line an endpoint when block style would be over a file's size limit; a warning
//! on stderr when even that is). It opens with a comment naming the version, its hash and the
//! server, and, when no `--version` was given (the current version then), how to change it:
//! in file mode by editing the control plane's policy file, in API mode by applying an edit
//! of it only while it is still current (`--expected-version N`): a version looked up
//! after the `get` may be a newer one, whose changes an edit of the older one would undo. The
//! comment is left out (with a note on stderr) when it would take the file over the size limit, and with
//! `--no-header` (for a file kept in version control, which would otherwise change with the
//! server's address and the version's number). `--output json` prints one object: the version's metadata
//! (`version`, `content_hash`, `source`, `author`, `created_unix_ms`, `created`, `summary`,
//! `rolled_back_from`) and `policies`, the document (see `json::document` for its shape).

use retryplane_policy::yaml::MAX_FILE_BYTES;
use serde_json::Value;

use super::client::Client;
use super::{Server, ServerArgs, block_on, json};
use crate::output;
use crate::{Outcome, Report};

/// `--output` of `get`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GetFormat {
    /// A policy file.
    #[default]
    Yaml,
    /// One JSON object with the version's metadata.
    Json,
}

/// `retryplane get` flags, as parsed. `--version N` names a policy version here, so the
/// program's own version flag is `-V` alone for this command.
#[derive(Debug, clap::Args)]
#[command(disable_version_flag = true)]
pub struct Args {
    /// A past version instead of the current one.
    #[arg(long, value_name = "N", value_parser = crate::flags::at_least_one)]
    version: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t, alias = "format")]
    output: GetFormat,
    /// YAML without its opening comment (version, hash, server, how to apply an edit): the
    /// policies alone, as for a file kept in version control.
    #[arg(long)]
    no_header: bool,
    /// Print the program's version (`-V` alone: `--version` names a policy version here).
    #[arg(short = 'V', action = clap::ArgAction::Version)]
    print_version: (),
    #[command(flatten)]
    server: ServerArgs,
}

/// What to get, checked once.
#[derive(Debug)]
pub struct Settings {
    /// The version; `None` for the current one.
    pub version: Option<u64>,
    /// Output format.
    pub format: GetFormat,
    /// Whether YAML opens with the comment naming the version (no `--no-header`).
    pub header: bool,
    /// The control plane.
    pub server: Server,
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> anyhow::Result<Self> {
        if args.no_header && args.output == GetFormat::Json {
            anyhow::bail!("--no-header is for --output yaml: JSON has no header to leave out");
        }
        Ok(Self {
            version: args.version,
            format: args.output,
            header: !args.no_header,
            server: args.server.try_into()?,
        })
    }
}

/// Calls `Get` and prints the version.
pub fn run(settings: &Settings) -> anyhow::Result<Report> {
    block_on(async {
        let mut client = Client::connect(&settings.server).await?;
        let request = retryplane_proto::pb::GetRequest {
            version: settings.version.unwrap_or(0),
        };
        let response = match client.get(request).await {
            Ok(response) => response,
            Err(status) => return Ok(super::failed(&status, String::new())),
        };
        let stdout = match settings.format {
            GetFormat::Yaml => {
                let mut yaml = response.yaml;
                if !yaml.is_empty() && !yaml.ends_with('\n') {
                    yaml.push('\n');
                }
                if let Some(info) = response.info.as_ref().filter(|_| settings.header) {
                    let header = header(info, &settings.server.url, settings.version.is_none());
                    if header.len() + yaml.len() <= MAX_FILE_BYTES {
                        yaml.insert_str(0, &header);
                    } else {
                        output::note(format_args!(
                            "retryplane: note: the opening comment (version {}, sha256 {}) is \
                             left out: it would take the file over the {MAX_FILE_BYTES} bytes a \
                             policy file may be",
                            info.version,
                            super::short_hash(&info.content_hash)
                        ));
                    }
                }
                // The control plane renders a version within the limit when it can (one line
                // an endpoint); a document sent through the API, or a file's aliases written
                // out, may still be over it.
                if yaml.len() > MAX_FILE_BYTES {
                    output::note(format_args!(
                        "retryplane: warning: this version is {} bytes as a policy file, over the \
                         {MAX_FILE_BYTES} bytes a policy file may be: `validate`, `apply` and \
                         the control plane's file mode refuse it as it is",
                        yaml.len()
                    ));
                }
                yaml
            }
            GetFormat::Json => output::json(&get_json(&response))?,
        };
        Ok(Report {
            stdout,
            outcome: Outcome::Success,
        })
    })
}

/// The comment a policy file printed by `get` opens with (see the module docs).
fn header(info: &retryplane_proto::pb::VersionInfo, server: &str, current: bool) -> String {
    let version = info.version;
    let mut header = format!(
        "# version {version} (sha256 {}) from {}\n",
        super::short_hash(&info.content_hash),
        output::spaced(server)
    );
    if current {
        header.push_str(&format!(
            "# in file mode, edit the control plane's own policy file; in API mode, to apply an \
             edit of it only while it is current: retryplane apply FILE --expected-version \
             {version}\n"
        ));
    }
    header
}

/// The metadata of the version and its `policies`.
fn get_json(response: &retryplane_proto::pb::GetResponse) -> Value {
    let mut o = response
        .info
        .as_ref()
        .map(json::version_info)
        .unwrap_or_default();
    o.insert(
        "policies".to_owned(),
        response
            .policies
            .as_ref()
            .map_or(Value::Null, json::document),
    );
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use retryplane_proto::pb;
    use serde_json::json;

    use super::*;

    #[test]
    fn json_holds_the_metadata_and_the_document() {
        let response = pb::GetResponse {
            info: Some(pb::VersionInfo {
                version: 3,
                content_hash: "ff".to_owned(),
                source: "rollback".to_owned(),
                author: "ops".to_owned(),
                created_unix_ms: 0,
                summary: "no changes".to_owned(),
                rolled_back_from: 1,
            }),
            policies: Some(pb::PolicyDocument {
                defaults: None,
                endpoints: vec![pb::Endpoint {
                    name: "inventory".to_owned(),
                    ..Default::default()
                }],
            }),
            yaml: String::new(),
        };
        assert_eq!(
            get_json(&response),
            json!({
                "version": 3, "content_hash": "ff", "source": "rollback", "author": "ops",
                "created_unix_ms": 0, "created": "1970-01-01T00:00:00Z",
                "summary": "no changes", "rolled_back_from": 1,
                "policies": {"defaults": {}, "endpoints": [{"name": "inventory"}]}
            })
        );
    }
}
