//! `retryplane-bench-store`: what the control plane's version store keeps per version.
//!
//! Every version is kept whole (SPEC §3), so the store grows with each one. This publishes `V`
//! versions of the fan-out bench's policy file (`E` endpoints, one `defaults` field changed per
//! version: the same kind of change the fan-out bench makes) into the real store
//! ([`RedbStore`], in a temp directory, durable commits), then reads the store's file with
//! redb itself and sums what each version's record takes. It reports, per version:
//!
//! - **stored**: the record's bytes in the `versions` table (metadata, checksum and the
//!   document as stored: compressed since record format 2);
//! - **encoded**: the document's protobuf encoding, which is what a record of format 1 held
//!   (the baseline, measured in the same run);
//! - the ratio of the two, and the store file's length (redb grows it ahead of its use);
//! - the time to compress and to inflate the last version's document with the store's own
//!   functions (`compress_document`, `inflate_document`), against the time to encode it to protobuf, which
//!   every publish pays already (the baseline, in the same run; medians of 31 rounds).
//!
//! Sizes do not depend on the machine or its load, nor on the build's profile; times do (build
//! with `--release`, and read the ratios).
//!
//! ```sh
//! cargo run --release -p retryplane-bench --bin retryplane-bench-store -- --endpoints 1000 --versions 200
//! ```

mod policy;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use prost::Message as _;
use redb::{ReadableDatabase as _, ReadableTable as _};
use retryplane_proto::{convert, pb};
use retryplane_server::store::{
    NewVersion, RedbStore, Source, VersionStore as _, compress_document, inflate_document,
};

/// The store's table of records, as the store names it.
const VERSIONS: redb::TableDefinition<'_, u64, &[u8]> = redb::TableDefinition::new("versions");

#[derive(Debug, Parser)]
#[command(about = "Bytes the version store keeps per version of a policy file")]
struct Args {
    /// Endpoints in the policy file.
    #[arg(long, default_value_t = 1000)]
    endpoints: usize,
    /// Versions published.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    versions: u64,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retryplane-bench-store: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("cannot make a temporary directory")?;
    let store = RedbStore::open(dir.path()).context("cannot open the store")?;
    let path = store.path().to_owned();
    let mut encoded: u64 = 0;
    let mut yaml_bytes = 0;
    let mut last = pb::PolicyDocument::default();
    for round in 0..args.versions {
        let yaml = policy::policy_yaml(args.endpoints, round);
        yaml_bytes = yaml.len();
        if round == 0 {
            policy::check(&yaml, args.endpoints)?;
        }
        let loaded = retryplane_policy::load(yaml.as_bytes());
        let set = loaded
            .policies
            .context("the generated policy file is invalid")?;
        let document = pb::PolicyDocument::from(set.document().as_ref());
        encoded += u64::try_from(document.encoded_len())?;
        last.clone_from(&document);
        store
            .publish(
                NewVersion {
                    content_hash: convert::content_hash(&document),
                    document,
                    source: Source::Admin,
                    author: Some("bench".to_owned()),
                    summary: "+0 endpoints, -0, 0 modified, defaults modified".to_owned(),
                    created_unix_ms: 1_700_000_000_000 + round,
                },
                None,
            )
            .with_context(|| format!("cannot publish version {}", round + 1))?;
    }
    drop(store);
    let file_len = std::fs::metadata(&path)?.len();
    let db = redb::Database::open(&path).context("cannot open the store's file with redb")?;
    let txn = db.begin_read()?;
    let versions = txn.open_table(VERSIONS)?;
    let mut stored: u64 = 0;
    let mut count: u64 = 0;
    for entry in versions.iter()? {
        let (_, value) = entry?;
        stored += u64::try_from(value.value().len())?;
        count += 1;
    }
    anyhow::ensure!(
        count == args.versions,
        "{count} records for {} versions",
        args.versions
    );
    // Whole numbers of bytes: the ratio is what to read.
    #[allow(clippy::cast_precision_loss)]
    let (stored_each, encoded_each) = (stored as f64 / count as f64, encoded as f64 / count as f64);
    println!(
        "{} versions of a {}-endpoint policy file ({} bytes of YAML)",
        count, args.endpoints, yaml_bytes
    );
    println!(
        "stored per version:  {:.0} bytes ({:.1} KiB)",
        stored_each,
        stored_each / 1024.0
    );
    println!(
        "encoded per version: {:.0} bytes ({:.1} KiB), what an uncompressed record held",
        encoded_each,
        encoded_each / 1024.0
    );
    println!("stored / encoded:    {:.3}", stored_each / encoded_each);
    println!(
        "store file length:   {} bytes ({:.1} KiB a version)",
        file_len,
        file_len as f64 / count as f64 / 1024.0
    );
    let (encode, compress, inflate) = times(&last)?;
    println!(
        "encode {:.3} ms, compress {:.3} ms ({:.2}x encode), inflate {:.3} ms ({:.2}x encode)",
        encode * 1e3,
        compress * 1e3,
        compress / encode,
        inflate * 1e3,
        inflate / encode
    );
    Ok(())
}

/// Medians, in seconds, of encoding `document` to protobuf, compressing that encoding as the
/// store does, and inflating it again (the store's own functions).
fn times(document: &pb::PolicyDocument) -> anyhow::Result<(f64, f64, f64)> {
    const ROUNDS: usize = 31;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut encode, mut compress, mut inflate) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let start = tokio::time::Instant::now();
        let bytes = std::hint::black_box(document.encode_to_vec());
        encode.push(start.elapsed().as_secs_f64());
        let start = tokio::time::Instant::now();
        let compressed = std::hint::black_box(compress_document(&bytes)?);
        compress.push(start.elapsed().as_secs_f64());
        let start = tokio::time::Instant::now();
        let back = inflate_document(1, compressed)?;
        inflate.push(start.elapsed().as_secs_f64());
        anyhow::ensure!(back == bytes, "the document did not come back as it was");
    }
    Ok((median(encode), median(compress), median(inflate)))
}
