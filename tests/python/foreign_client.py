"""A client in another language: Python's grpcio, with stubs generated here from proto/.

It speaks the `retryplane.v1` contract as the `.proto` files write it, nothing of the Rust crates:
an agent stream (Hello, Snapshot, Ack, MetricsReport and its MetricsAck), then the admin service
(Apply, Get, FleetStatus, Stats). Run by tests/foreign_client.rs against a real control plane:

    python foreign_client.py PROTO_DIR AGENT_ADDR ADMIN_ADDR

Prints one JSON object with what it saw on stdout; exits 1 with the reason on stderr when
anything is not as the contract says. Every wait is bounded.
"""

import atexit
import json
import os
import queue
import shutil
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc

WAIT_S = 30


def fail(message):
    print(f"foreign client: {message}", file=sys.stderr)
    sys.exit(1)


def expect(condition, message):
    if not condition:
        fail(message)


def generate(proto_dir):
    """Python stubs of every .proto under proto_dir, importable as retryplane.v1.*_pb2."""
    out = tempfile.mkdtemp(prefix="retryplane-py-")
    # Removed when the client exits, however it exits (fail() exits too).
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    sources = []
    for root, _, files in os.walk(proto_dir):
        sources += [os.path.join(root, f) for f in sorted(files) if f.endswith(".proto")]
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    code = protoc.main(
        ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
         f"--python_out={out}", f"--grpc_python_out={out}", *sources]
    )
    expect(code == 0, f"protoc failed on {sources} ({code})")
    sys.path.insert(0, out)


def main():
    proto_dir, agent_addr, admin_addr = sys.argv[1:4]
    generate(proto_dir)
    from retryplane.v1 import admin_pb2, admin_pb2_grpc, agent_pb2, agent_pb2_grpc, policy_pb2

    seen = {}

    # --- the agent stream -------------------------------------------------------------
    outbound = queue.Queue()

    def requests():
        while True:
            message = outbound.get()
            if message is None:
                return
            yield message

    agent_channel = grpc.insecure_channel(agent_addr)
    stream = agent_pb2_grpc.AgentServiceStub(agent_channel).Connect(requests(), timeout=WAIT_S)
    outbound.put(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        agent_id="python-agent",
        service="checkout",
        labels={"lang": "python"},
        agent_version="grpcio-" + grpc.__version__,
        instance_id=42,
    )))
    first = next(stream)
    expect(first.WhichOneof("kind") == "snapshot", f"first message is {first}")
    snapshot = first.snapshot
    metadata = dict(stream.initial_metadata())
    seen["metrics_ack_metadata"] = metadata.get("retryplane-metrics-ack", "")
    seen["first_version"] = snapshot.version
    seen["content_hash"] = snapshot.content_hash
    seen["endpoints"] = [e.name for e in snapshot.policies.endpoints]
    payments = next(e for e in snapshot.policies.endpoints if e.name == "payments")
    seen["payments_max_attempts"] = payments.overlay.max_attempts
    seen["payments_routes"] = [
        (r.match.http.method, r.match.http.path_prefix) for r in payments.routes
    ]
    seen["defaults_backoff_base_ms"] = snapshot.policies.defaults.backoff.base_ms
    seen["defaults_jitter"] = policy_pb2.Jitter.Name(snapshot.policies.defaults.backoff.jitter)
    seen["metrics_interval_ms"] = snapshot.metrics_interval_ms
    outbound.put(agent_pb2.AgentMessage(
        ack=agent_pb2.Ack(version=snapshot.version, nonce=snapshot.nonce)
    ))
    outbound.put(agent_pb2.AgentMessage(metrics=agent_pb2.MetricsReport(
        window_start_unix_ms=1, window_end_unix_ms=2, policy_version=snapshot.version, seq=1,
        endpoints=[agent_pb2.EndpointCounters(
            endpoint="payments", calls=10, attempts=13, retries=3, success_first_try=8,
            success_after_retry=1, gave_up_attempts=1, backoff_ms=250,
        )],
    )))
    ack = next(stream)
    expect(ack.WhichOneof("kind") == "metrics_ack", f"answer to the report is {ack}")
    seen["metrics_ack"] = {"seq": ack.metrics_ack.seq, "dropped": ack.metrics_ack.dropped}

    # --- the admin service ------------------------------------------------------------
    admin = admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(admin_addr))
    change = admin_pb2.PolicySource(
        yaml="version: 1\nendpoints:\n  payments:\n    max_attempts: 5\n  search: {}\n",
        origin="python",
    )
    dry_run = admin.Apply(admin_pb2.ApplyRequest(
        source=change, expected_version=snapshot.version, dry_run=True,
    ), timeout=WAIT_S)
    seen["dry_run"] = {
        "version": dry_run.version,
        "content_hash": dry_run.content_hash,
        "changed": dry_run.changed,
        "would_change": dry_run.would_change,
        "new_content_hash": dry_run.new_content_hash,
    }
    applied = admin.Apply(admin_pb2.ApplyRequest(
        source=change, expected_version=snapshot.version,
    ), timeout=WAIT_S)
    seen["applied"] = {"version": applied.version, "changed": applied.changed}
    pushed = next(stream)
    expect(pushed.WhichOneof("kind") == "snapshot", f"after Apply the stream sent {pushed}")
    seen["pushed_version"] = pushed.snapshot.version
    seen["pushed_payments_max_attempts"] = next(
        e for e in pushed.snapshot.policies.endpoints if e.name == "payments"
    ).overlay.max_attempts
    outbound.put(agent_pb2.AgentMessage(
        ack=agent_pb2.Ack(version=pushed.snapshot.version, nonce=pushed.snapshot.nonce)
    ))

    current = admin.Get(admin_pb2.GetRequest(), timeout=WAIT_S)
    seen["get"] = {
        "version": current.info.version,
        "content_hash": current.info.content_hash,
        "source": current.info.source,
        "yaml_has_payments": "payments:" in current.yaml,
    }
    # The ACK is sent on the stream; FleetStatus shows it once the server has read it (polled,
    # at most 300 times).
    for _ in range(300):
        fleet = admin.FleetStatus(admin_pb2.FleetStatusRequest(), timeout=WAIT_S)
        agent = next((a for a in fleet.agents if a.agent_id == "python-agent"), None)
        if agent is not None and agent.applied_version == pushed.snapshot.version:
            break
        time.sleep(0.05)
    expect(agent is not None, "FleetStatus does not list the agent")
    seen["fleet"] = {
        "applied_version": agent.applied_version,
        "last_response": agent.last_response,
        "service": agent.service,
        "labels": dict(agent.labels),
        "connected": agent.connected,
    }
    stats = admin.Stats(admin_pb2.StatsRequest(endpoint="payments"), timeout=WAIT_S)
    totals = next((e for e in stats.endpoints if e.endpoint == "payments"), None)
    expect(totals is not None, f"Stats has no payments: {stats}")
    seen["stats"] = {"calls": totals.calls, "retries": totals.retries,
                     "backoff_ms": totals.backoff_ms}

    outbound.put(None)
    stream.cancel()
    print(json.dumps(seen))


if __name__ == "__main__":
    try:
        main()
    except grpc.RpcError as e:
        fail(f"gRPC error {e.code()}: {e.details()}")
    except StopIteration:
        fail("the stream ended early")
