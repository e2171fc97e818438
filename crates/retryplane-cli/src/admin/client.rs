//! A connected `AdminService` client that adds the token to every call.

use anyhow::Context as _;
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::Server;

/// The largest answer the CLI decodes. tonic's default is 4 MiB; `Stats` for a fleet near the
/// server's series cap (10,000 series with their windows) and `get` of a large policy can pass
/// it.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Agents asked for per `FleetStatus` page: an agent may carry 64 labels of 256-byte keys
/// and values (about 33 KiB), so a page stays under [`MAX_RESPONSE_BYTES`] (about 33 MiB at
/// worst, a few hundred KiB in practice).
pub const FLEET_PAGE: u32 = 1_000;

/// One connection to the admin service.
#[derive(Debug)]
pub struct Client {
    inner: AdminServiceClient<Channel>,
    authorization: Option<MetadataValue<Ascii>>,
    /// The server's URL, for messages.
    url: String,
}

impl Client {
    /// Connects now, so that an unreachable server is reported as such (exit 2) before any
    /// call is attempted.
    pub async fn connect(server: &Server) -> anyhow::Result<Self> {
        let channel = server
            .endpoint
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}{}", server.url, server.origin))?;
        Ok(Self {
            inner: AdminServiceClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES),
            authorization: server.authorization.clone(),
            url: server.url.clone(),
        })
    }

    /// A call that failed on the connection (it broke before an answer, or what listens there
    /// does not speak gRPC: an HTTP/1 server, another protocol) is `UNAVAILABLE`, gRPC's code
    /// for it, naming the server and what broke; tonic makes it `UNKNOWN: transport error` or
    /// `INTERNAL: h2 protocol error`, which say neither. Any other status is kept as it is,
    /// `CANCELLED` included: the request timeout, which `super::failed` shows as a deadline.
    fn connection_failure(&self, status: Status) -> Status {
        match std::error::Error::source(&status) {
            Some(source) if broke_on_connection(&status) => Status::unavailable(format!(
                "the connection to {} failed before an answer: {}",
                self.url,
                retryplane_server::ErrorChain(source)
            )),
            _ => status,
        }
    }

    /// The answer of a call that only reads (it changes nothing, so sending it twice is
    /// harmless): sent once more, at once, when its connection broke before an answer. The
    /// control plane closes a connection left idle, and one it restarted is gone: the channel
    /// finds out only with the call it sends on it, which tonic does not send again.
    async fn read<M: Clone, T>(
        &mut self,
        message: M,
        call: impl AsyncFn(
            &mut AdminServiceClient<Channel>,
            Request<M>,
        ) -> Result<tonic::Response<T>, Status>,
    ) -> Result<T, Status> {
        self.read_with_metadata(message, call)
            .await
            .map(tonic::Response::into_inner)
    }

    /// [`Client::read`], keeping the answer's metadata; a failed call's status as
    /// [`Client::connection_failure`] makes it.
    async fn read_with_metadata<M: Clone, T>(
        &mut self,
        message: M,
        call: impl AsyncFn(
            &mut AdminServiceClient<Channel>,
            Request<M>,
        ) -> Result<tonic::Response<T>, Status>,
    ) -> Result<tonic::Response<T>, Status> {
        let request = self.request(message.clone());
        let answer = match call(&mut self.inner, request).await {
            Err(status) if broke_on_connection(&status) => {
                let request = self.request(message);
                call(&mut self.inner, request).await
            }
            answer => answer,
        };
        answer.map_err(|status| self.connection_failure(status))
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        request
    }

    /// `Validate`.
    pub async fn validate(
        &mut self,
        message: pb::ValidateRequest,
    ) -> Result<pb::ValidateResponse, Status> {
        self.read(message, async |c, r| c.validate(r).await).await
    }

    /// The answer of a call that changes something: sent once (the server may have done it),
    /// and when its answer did not come (the request timeout, a connection that broke), the
    /// status says the change may have been made: the request may have reached the server
    /// before the answer was lost, and `history` shows whether it did.
    fn write<T>(&self, answer: Result<tonic::Response<T>, Status>) -> Result<T, Status> {
        answer.map(tonic::Response::into_inner).map_err(|status| {
            if super::timed_out(&status) {
                Status::deadline_exceeded(format!(
                    "no answer from the server within {} s; {MAY_BE_STORED}",
                    super::REQUEST_TIMEOUT.as_secs()
                ))
            } else if broke_on_connection(&status) {
                let status = self.connection_failure(status);
                Status::unavailable(format!("{}; {MAY_BE_STORED}", status.message()))
            } else {
                status
            }
        })
    }

    /// `Apply`. A dry run (`diff`) only reads, and is sent once more as the other reads are.
    pub async fn apply(&mut self, message: pb::ApplyRequest) -> Result<pb::ApplyResponse, Status> {
        if message.dry_run {
            return self.read(message, async |c, r| c.apply(r).await).await;
        }
        let request = self.request(message);
        let answer = self.inner.apply(request).await;
        self.write(answer)
    }

    /// `Get`. A version the control plane answered from memory, its store failing, is noted
    /// on stderr: the answer is right, and the store needs attention.
    pub async fn get(&mut self, message: pb::GetRequest) -> Result<pb::GetResponse, Status> {
        let answer = self
            .read_with_metadata(message, async |c, r| c.get(r).await)
            .await?;
        if answer
            .metadata()
            .contains_key(retryplane_proto::FROM_MEMORY_METADATA)
        {
            crate::output::note(format_args!(
                "retryplane: warning: the control plane's version store is failing (see its \
                 log): version {} was answered from its memory, as it serves it to agents; \
                 save it before a restart",
                answer.get_ref().info.as_ref().map_or(0, |i| i.version)
            ));
        }
        Ok(answer.into_inner())
    }

    /// `History`.
    pub async fn history(
        &mut self,
        message: pb::HistoryRequest,
    ) -> Result<pb::HistoryResponse, Status> {
        self.read(message, async |c, r| c.history(r).await).await
    }

    /// `Rollback`.
    pub async fn rollback(
        &mut self,
        message: pb::RollbackRequest,
    ) -> Result<pb::ApplyResponse, Status> {
        let request = self.request(message);
        let answer = self.inner.rollback(request).await;
        self.write(answer)
    }

    /// `FleetStatus`, every agent: asked for in pages of [`FLEET_PAGE`] agents, put together
    /// by [`whole_fleet`].
    pub async fn fleet_status(&mut self) -> Result<pb::FleetStatusResponse, Status> {
        whole_fleet(async |token| {
            self.fleet_status_with(pb::FleetStatusRequest {
                page_size: FLEET_PAGE,
                page_token: token,
                ..Default::default()
            })
            .await
        })
        .await
    }

    /// `FleetStatus` with `message` (`counts_only` leaves the agent list out).
    pub async fn fleet_status_with(
        &mut self,
        message: pb::FleetStatusRequest,
    ) -> Result<pb::FleetStatusResponse, Status> {
        self.read(message, async |c, r| c.fleet_status(r).await)
            .await
    }

    /// `Stats`.
    pub async fn stats(&mut self, message: pb::StatsRequest) -> Result<pb::StatsResponse, Status> {
        self.read(message, async |c, r| c.stats(r).await).await
    }
}

/// What a write whose answer was lost says of its change.
const MAY_BE_STORED: &str =
    "the change may have been stored all the same: `retryplane history` shows whether it was";

/// Whether a call failed on its connection (it broke before an answer, or what listens there
/// does not speak gRPC), as tonic reports it: a transport error under any code (hyper's
/// "operation was canceled" for a connection closed at once is `CANCELLED`), but not the
/// request timeout (also `CANCELLED`).
fn broke_on_connection(status: &Status) -> bool {
    !super::timed_out(status)
        && std::error::Error::source(status).is_some_and(|s| s.is::<tonic::transport::Error>())
}

/// Every agent, from the `FleetStatus` pages `page` answers for each page token (empty for the
/// first), in one answer whose version and counts are the last page's, and whose alerting
/// endpoints are the first page's (the only one that carries them).
async fn whole_fleet(
    mut page: impl AsyncFnMut(String) -> Result<pb::FleetStatusResponse, Status>,
) -> Result<pb::FleetStatusResponse, Status> {
    let mut token = String::new();
    let mut agents = Vec::new();
    let mut alerting = None;
    loop {
        let mut answer = page(token.clone()).await?;
        agents.append(&mut answer.agents);
        let first = alerting.get_or_insert_with(|| std::mem::take(&mut answer.alerting_endpoints));
        let next = std::mem::take(&mut answer.next_page_token);
        // A server that predates paging answers every agent and no token. Ids only go up from
        // page to page, so a token that does not would never end.
        if next.is_empty() || next <= token {
            answer.agents = agents;
            answer.alerting_endpoints = std::mem::take(first);
            return Ok(answer);
        }
        token = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agents(ids: &[&str], next: &str, known: u32) -> pb::FleetStatusResponse {
        pb::FleetStatusResponse {
            agents: ids
                .iter()
                .map(|&id| pb::AgentStatus {
                    agent_id: id.to_owned(),
                    ..Default::default()
                })
                .collect(),
            next_page_token: next.to_owned(),
            known_agents: known,
            ..Default::default()
        }
    }

    async fn collect(pages: &[pb::FleetStatusResponse]) -> (Vec<String>, Vec<String>, u32) {
        let mut asked = Vec::new();
        let mut left = pages.iter();
        let whole = whole_fleet(async |token| {
            asked.push(token);
            Ok(left.next().cloned().unwrap_or_default())
        })
        .await
        .unwrap();
        let ids = whole.agents.into_iter().map(|a| a.agent_id).collect();
        (ids, asked, whole.known_agents)
    }

    #[tokio::test]
    async fn fleet_pages_are_put_together_until_the_last() {
        let mut first = agents(&["a", "b"], "b", 4);
        first.alerting_endpoints = vec!["payments".to_owned()];
        let pages = [first, agents(&["c", "d"], "", 5)];
        let mut left = pages.iter();
        let whole = whole_fleet(async |_| Ok(left.next().cloned().unwrap_or_default()))
            .await
            .unwrap();
        assert_eq!(whole.alerting_endpoints, ["payments"], "the first page's");
        let (ids, asked, known) = collect(&pages).await;
        assert_eq!(ids, ["a", "b", "c", "d"]);
        assert_eq!(asked, ["", "b"]);
        assert_eq!(known, 5, "the last page's counts");
        // A server that predates paging answers everything at once.
        let (ids, asked, _) = collect(&[agents(&["a", "b", "c"], "", 3)]).await;
        assert_eq!((ids.len(), asked.len()), (3, 1));
        // A token that does not move on ends the walk instead of looping.
        let pages = [agents(&["a", "b"], "b", 2), agents(&["b"], "b", 2)];
        let (ids, asked, _) = collect(&pages).await;
        assert_eq!(
            (ids, asked),
            (
                vec!["a".into(), "b".into(), "b".into()],
                vec!["".into(), "b".into()]
            )
        );
    }
}
