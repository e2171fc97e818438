//! Compiles `proto/retryplane/v1/*.proto` with protox, a pure-Rust protobuf compiler, so a
//! fresh machine needs no `protoc`; writes the descriptor set for gRPC reflection beside the
//! generated code.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = ["policy", "agent", "admin"].map(|f| root.join(format!("retryplane/v1/{f}.proto")));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("retryplane_v1_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        // ServerMessage keeps its snapshot encoded, so one encoding serves every stream.
        .extern_path(
            ".retryplane.v1.ServerMessage",
            "crate::frame::ServerMessage",
        )
        .compile_fds(fds)?;
    Ok(())
}
