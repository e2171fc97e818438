//! Shared pieces of the end-to-end tests: a real control plane on `127.0.0.1:0` with its own
//! data directory and policy file, and a raw protocol agent that speaks the stream by hand.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use retryplane_proto::pb::{self, agent_message::Kind};
use retryplane_server::server::{Running, ServeConfig, start};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

/// How long any single wait in these tests may take before it counts as a failure.
pub const WAIT: Duration = Duration::from_secs(10);

/// A small valid policy file with `n` endpoints and `max_attempts` on the first.
pub fn policy_yaml(endpoints: usize, max_attempts: u32) -> String {
    let mut s = String::from("version: 1\nendpoints:\n");
    for i in 0..endpoints {
        if i == 0 {
            s.push_str(&format!("  ep-{i}:\n    max_attempts: {max_attempts}\n"));
        } else {
            s.push_str(&format!("  ep-{i}: {{}}\n"));
        }
    }
    s
}

/// A control plane with its own temp dir.
pub struct Plane {
    /// The running server.
    pub running: Running,
    /// Holds the data dir and policy file.
    pub dir: tempfile::TempDir,
}

impl Plane {
    /// Starts a server in file mode on `policy`.
    pub async fn file_mode(policy: &str) -> Plane {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("policies.yaml"), policy).unwrap();
        Self::start_in(dir, false, None).await
    }

    /// Starts a server in API mode, seeded with `policy`.
    pub async fn api_mode(policy: &str) -> Plane {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("policies.yaml"), policy).unwrap();
        Self::start_in(dir, true, None).await
    }

    /// Starts a server over an existing directory (a restart).
    pub async fn start_in(dir: tempfile::TempDir, api: bool, tokens: Option<PathBuf>) -> Plane {
        Self::start_with(dir, api, tokens, |_| {}).await
    }

    /// Starts a server over `dir` with the test configuration as changed by `change`.
    pub async fn start_with(
        dir: tempfile::TempDir,
        api: bool,
        tokens: Option<PathBuf>,
        change: impl FnOnce(&mut ServeConfig),
    ) -> Plane {
        let mut cfg = config(dir.path(), api, tokens);
        change(&mut cfg);
        let running = start(cfg).await.expect("server starts");
        Plane { running, dir }
    }

    /// Starts a server in API mode, seeded with `policy`, with `tune` applied to its
    /// configuration.
    pub async fn api_mode_with(policy: &str, tune: impl FnOnce(&mut ServeConfig)) -> Plane {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("policies.yaml"), policy).unwrap();
        let mut cfg = config(dir.path(), true, None);
        tune(&mut cfg);
        let running = start(cfg).await.expect("server starts");
        Plane { running, dir }
    }

    /// Applies `policy` through the admin API; the new version.
    pub async fn apply(&self, policy: &str) -> u64 {
        let applied = self
            .admin()
            .await
            .apply(pb::ApplyRequest {
                source: Some(pb::PolicySource {
                    kind: Some(pb::policy_source::Kind::Yaml(policy.to_owned())),
                    origin: "test".into(),
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(applied.changed);
        applied.version
    }

    /// The policy file path.
    pub fn policy_path(&self) -> PathBuf {
        self.dir.path().join("policies.yaml")
    }

    /// A channel to the agent listener.
    pub async fn agent_channel(&self) -> Channel {
        channel(self.running.agent_addr).await
    }

    /// A new agent `id` on a channel of its own, its Hello naming no version.
    pub async fn agent(&self, id: &str) -> RawAgent {
        RawAgent::connect(self.agent_channel().await, hello(id, 0, ""))
            .await
            .unwrap()
    }

    /// [`Plane::agent`], once its first snapshot came, which must be that of `version`.
    pub async fn agent_on(&self, id: &str, version: u64) -> RawAgent {
        let mut agent = self.agent(id).await;
        let first = agent.next_snapshot().await.unwrap().version;
        assert_eq!(first, version, "{id}'s first snapshot");
        agent
    }

    /// Waits until the fleet status shows agent `id` as `check` wants; `what` names it.
    pub async fn until_agent(
        &self,
        id: &str,
        what: &str,
        check: impl Fn(&pb::AgentStatus) -> bool,
    ) {
        eventually(what, || async {
            agent_status(self, id).await.is_some_and(|s| check(&s))
        })
        .await;
    }

    /// A channel to the admin listener.
    pub async fn admin_channel(&self) -> Channel {
        channel(self.running.admin_addr).await
    }

    /// An admin client.
    pub async fn admin(&self) -> pb::admin_service_client::AdminServiceClient<Channel> {
        pb::admin_service_client::AdminServiceClient::new(self.admin_channel().await)
    }

    /// An agent `id` (process `instance`) on its own connection that has ACKed the snapshot
    /// it was sent first, and that snapshot.
    pub async fn acked_agent(&self, id: &str, instance: u64) -> (RawAgent, pb::Snapshot) {
        let mut agent = RawAgent::connect(self.agent_channel().await, hello_instance(id, instance))
            .await
            .unwrap();
        let first = agent.next_snapshot().await.unwrap();
        agent.ack(&first).await;
        (agent, first)
    }
}

/// The server configuration the tests use: every listener on an ephemeral loopback port.
pub fn config(dir: &Path, api: bool, tokens: Option<PathBuf>) -> ServeConfig {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        tokens_file: tokens,
        api_mode: api,
        ..ServeConfig::default()
    }
}

/// A channel to `addr`.
pub async fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .connect()
        .await
        .unwrap()
}

/// An agent that speaks the stream protocol by hand.
pub struct RawAgent {
    /// Messages to the server.
    pub tx: mpsc::Sender<pb::AgentMessage>,
    /// Messages from the server.
    pub rx: Streaming<pb::ServerMessage>,
}

/// A Hello for `id` from agent process `instance` (which numbers its metrics reports).
pub fn hello_instance(id: &str, instance: u64) -> pb::AgentMessage {
    let mut message = hello(id, 0, "");
    if let Some(Kind::Hello(h)) = &mut message.kind {
        h.instance_id = instance;
    }
    message
}

/// A metrics report numbered `seq` (0: not numbered) of `calls` calls to `endpoint`.
pub fn report(seq: u64, endpoint: &str, calls: u64) -> Kind {
    Kind::Metrics(pb::MetricsReport {
        seq,
        endpoints: vec![pb::EndpointCounters {
            endpoint: endpoint.to_owned(),
            calls,
            attempts: calls,
            ..Default::default()
        }],
        ..Default::default()
    })
}

/// A Hello for `id`.
pub fn hello(id: &str, last_version: u64, last_hash: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        kind: Some(Kind::Hello(pb::Hello {
            agent_id: id.to_owned(),
            service: "checkout".to_owned(),
            agent_version: "test".to_owned(),
            last_applied_version: last_version,
            last_applied_hash: last_hash.to_owned(),
            ..Default::default()
        })),
    }
}

impl RawAgent {
    /// Opens a stream and sends `first` as its first message.
    pub async fn connect(
        channel: Channel,
        first: pb::AgentMessage,
    ) -> Result<RawAgent, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(first).await.unwrap();
        let mut client = pb::agent_service_client::AgentServiceClient::new(channel);
        let response = client.connect(ReceiverStream::new(rx)).await?;
        Ok(RawAgent {
            tx,
            rx: response.into_inner(),
        })
    }

    /// The next message, or the status the stream ended with.
    pub async fn next_message(&mut self) -> Result<pb::ServerMessage, tonic::Status> {
        tokio::time::timeout(WAIT, self.rx.message())
            .await
            .map_err(|_| tonic::Status::deadline_exceeded("no message from the server in time"))??
            .ok_or_else(|| tonic::Status::cancelled("stream ended"))
    }

    /// The next message, which must be a metrics ack: `(seq, dropped)`.
    pub async fn next_ack(&mut self) -> (u64, bool) {
        let message = self.next_message().await.unwrap();
        let ack = message.metrics_ack.expect("a metrics ack");
        (ack.seq, ack.dropped)
    }

    /// The next snapshot, or the status the stream ended with.
    pub async fn next_snapshot(&mut self) -> Result<pb::Snapshot, tonic::Status> {
        let message = self.next_message().await?;
        message
            .decode_snapshot()
            .map_err(|e| tonic::Status::internal(e.to_string()))?
            .ok_or_else(|| tonic::Status::internal("message without a snapshot"))
    }

    /// Acknowledges `snapshot`.
    pub async fn ack(&self, snapshot: &pb::Snapshot) {
        self.send(Kind::Ack(pb::Ack {
            version: snapshot.version,
            nonce: snapshot.nonce.clone(),
        }))
        .await;
    }

    /// Refuses `snapshot`.
    pub async fn nack(&self, snapshot: &pb::Snapshot, error: &str) {
        self.send(Kind::Nack(pb::Nack {
            version: snapshot.version,
            nonce: snapshot.nonce.clone(),
            error: error.to_owned(),
        }))
        .await;
    }

    /// Sends one message.
    pub async fn send(&self, kind: Kind) {
        self.tx
            .send(pb::AgentMessage { kind: Some(kind) })
            .await
            .unwrap();
    }
}

/// An agent that writes raw message bytes (each sent as one gRPC message), to send what no
/// well-behaved client would.
pub struct BytesAgent {
    /// Message bodies to the server.
    pub tx: mpsc::Sender<Vec<u8>>,
    /// Messages from the server.
    pub rx: Streaming<pb::ServerMessage>,
}

impl BytesAgent {
    /// Opens a stream and sends `first` as its first message body.
    pub async fn connect(channel: Channel, first: Vec<u8>) -> Result<BytesAgent, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(first).await.unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let response = grpc
            .streaming(
                tonic::Request::new(ReceiverStream::new(rx)),
                http::uri::PathAndQuery::from_static("/retryplane.v1.AgentService/Connect"),
                RawCodec::<pb::ServerMessage>::default(),
            )
            .await?;
        Ok(BytesAgent {
            tx,
            rx: response.into_inner(),
        })
    }

    /// The status the stream ends with, skipping any snapshots before it.
    pub async fn ended(&mut self) -> tonic::Status {
        ended(&mut self.rx).await
    }
}

/// The status `rx` ends with, skipping any messages before it.
async fn ended(rx: &mut Streaming<pb::ServerMessage>) -> tonic::Status {
    loop {
        match tokio::time::timeout(WAIT, rx.message()).await {
            Err(_) => panic!("the stream did not end within {WAIT:?}"),
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return tonic::Status::ok(""),
            Ok(Err(status)) => return status,
        }
    }
}

/// `message` as one gRPC message: the compressed-flag byte `flag`, the big-endian `u32`
/// length, the bytes.
pub fn framed(flag: u8, message: &[u8]) -> bytes::Bytes {
    let mut frame = bytes::BytesMut::with_capacity(5 + message.len());
    bytes::BufMut::put_u8(&mut frame, flag);
    bytes::BufMut::put_u32(&mut frame, u32::try_from(message.len()).unwrap());
    bytes::BufMut::put_slice(&mut frame, message);
    frame.freeze()
}

/// An agent that writes the request body itself, gRPC message headers included (see
/// [`framed`]), to send framing no gRPC client would.
pub struct FramedAgent {
    /// Body bytes to the server, sent as they are.
    pub tx: mpsc::Sender<bytes::Bytes>,
    /// Messages from the server.
    pub rx: Streaming<pb::ServerMessage>,
}

impl FramedAgent {
    /// Opens a `Connect` stream whose body starts with `first`; `Err` with the status of a
    /// refusal before the stream starts.
    pub async fn connect(
        mut channel: Channel,
        first: bytes::Bytes,
    ) -> Result<FramedAgent, tonic::Status> {
        use tokio_stream::StreamExt as _;
        use tonic::codegen::Service as _;
        let (tx, rx) = mpsc::channel(16);
        tx.send(first).await.unwrap();
        let frames = ReceiverStream::new(rx)
            .map(|bytes| Ok::<_, std::convert::Infallible>(http_body::Frame::data(bytes)));
        let request = http::Request::post("/retryplane.v1.AgentService/Connect")
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(tonic::body::Body::new(http_body_util::StreamBody::new(
                frames,
            )))
            .unwrap();
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let response = channel
            .call(request)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        if let Some(status) = tonic::Status::from_header_map(response.headers())
            && status.code() != tonic::Code::Ok
        {
            return Err(status);
        }
        let (parts, body) = response.into_parts();
        let rx = Streaming::new_response(
            ProstDecoderOf::<pb::ServerMessage>::default(),
            body,
            parts.status,
            None,
            None,
        );
        Ok(FramedAgent { tx, rx })
    }

    /// The status the stream ends with, skipping any messages before it.
    pub async fn ended(&mut self) -> tonic::Status {
        ended(&mut self.rx).await
    }
}

/// The encoder of [`RawCodec`]: the bytes as they are.
#[derive(Debug)]
pub struct BytesEncoder;

impl tonic::codec::Encoder for BytesEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

/// Writes raw bytes as each message sent; reads the answers as `T`s with prost: to send what
/// no well-behaved client would (an agent's raw messages, or a unary admin call holding what
/// a newer client's proto would write).
#[derive(Debug)]
pub struct RawCodec<T>(std::marker::PhantomData<T>);

impl<T> Default for RawCodec<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

/// The decoder of [`RawCodec`].
#[derive(Debug)]
pub struct ProstDecoderOf<T>(std::marker::PhantomData<T>);

impl<T> Default for ProstDecoderOf<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: prost::Message + Default + Send + 'static> tonic::codec::Codec for RawCodec<T> {
    type Encode = Vec<u8>;
    type Decode = T;
    type Encoder = BytesEncoder;
    type Decoder = ProstDecoderOf<T>;

    fn encoder(&mut self) -> BytesEncoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> ProstDecoderOf<T> {
        ProstDecoderOf::default()
    }
}

impl<T: prost::Message + Default> tonic::codec::Decoder for ProstDecoderOf<T> {
    type Item = T;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<T>, tonic::Status> {
        T::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

/// The unary admin call `path` (`/retryplane.v1.AdminService/Apply`) with `message` as its
/// raw request bytes, answered as a `T`.
pub async fn raw_admin_call<T: prost::Message + Default + Send + 'static>(
    plane: &Plane,
    path: &'static str,
    message: Vec<u8>,
) -> Result<T, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(plane.admin_channel().await);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(message),
        http::uri::PathAndQuery::from_static(path),
        RawCodec::<T>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

/// The server's `/metrics` text (empty when it cannot be read).
pub async fn metrics_text(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = String::new();
    let _ = stream.read_to_string(&mut body).await;
    body
}

/// The value of the unlabelled sample `name` in the server's `/metrics`, if present.
pub async fn metric(addr: SocketAddr, name: &str) -> Option<f64> {
    metrics_text(addr).await.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.parse().ok()).flatten()
    })
}

/// Polls `check` until it holds, at most [`WAIT`]; tokio's clock, no fixed sleeps hoping.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The fleet status row of `agent_id`.
pub async fn agent_status(plane: &Plane, agent_id: &str) -> Option<pb::AgentStatus> {
    let mut admin = plane.admin().await;
    let status = admin
        .fleet_status(pb::FleetStatusRequest::default())
        .await
        .ok()?
        .into_inner();
    status.agents.into_iter().find(|a| a.agent_id == agent_id)
}

/// The fleet-wide lifetime totals of `endpoint` (None before any report).
pub async fn endpoint_stats(plane: &Plane, endpoint: &str) -> Option<pb::EndpointStats> {
    let stats = plane
        .admin()
        .await
        .stats(pb::StatsRequest {
            endpoint: endpoint.to_owned(),
            ..Default::default()
        })
        .await
        .ok()?
        .into_inner();
    stats.endpoints.into_iter().find(|e| e.endpoint == endpoint)
}

/// The fleet's entry for `agent_id`, asked with the admin token `secret`.
pub async fn status_with(plane: &Plane, secret: &str, agent_id: &str) -> Option<pb::AgentStatus> {
    let mut request = tonic::Request::new(pb::FleetStatusRequest::default());
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {secret}").parse().unwrap());
    let fleet = plane
        .admin()
        .await
        .fleet_status(request)
        .await
        .unwrap()
        .into_inner();
    fleet.agents.into_iter().find(|a| a.agent_id == agent_id)
}

/// An agent of the service `checkout` connected to `plane` as `agent_id` with its token read
/// from `token_file`, reconnecting after 10 to 100 ms (a stream up `stable_after` is stable),
/// once it runs version 1.
pub async fn token_file_agent(
    plane: &Plane,
    agent_id: &str,
    token_file: &Path,
    stable_after: Duration,
    seed: u64,
) -> retryplane_agent::Agent {
    let agent = retryplane_agent::Agent::builder()
        .url(format!("http://{}", plane.running.agent_addr))
        .service("checkout")
        .agent_id(agent_id)
        .token_file(token_file)
        .reconnect_backoff(retryplane_agent::ReconnectBackoff::new(
            Duration::from_millis(10),
            Duration::from_millis(100),
            stable_after,
        ))
        .rng_seed(seed)
        .connect()
        .unwrap();
    eventually("the agent runs version 1", || async {
        agent.policies().version() == 1 && agent.is_connected()
    })
    .await;
    agent
}
