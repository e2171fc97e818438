//! Opening one raw agent stream, shared by both bench binaries.

use anyhow::Context as _;
use retryplane_proto::pb::{self, agent_message::Kind};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// Opens an agent stream on `channel` that says `hello` first; the stream's outbound side stays
/// open while the returned sender lives.
pub async fn open(
    channel: Channel,
    hello: pb::Hello,
) -> anyhow::Result<(
    mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::ServerMessage>,
)> {
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::AgentMessage {
        kind: Some(Kind::Hello(hello)),
    })
    .await
    .context("cannot queue Hello")?;
    let mut client = pb::agent_service_client::AgentServiceClient::new(channel);
    let inbound = client
        .connect(ReceiverStream::new(rx))
        .await
        .context("the server refused the stream")?
        .into_inner();
    Ok((tx, inbound))
}
