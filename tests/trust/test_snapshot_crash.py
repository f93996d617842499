"""A SIGKILL while CreateSnapshot copies a large backlog: after the restart the snapshot is either absent
(and the client's retry creates it whole) or whole, never one that holds nothing.

``hedgepub serve`` (SQLite) holds a backlog of ``HEDGEPUB_TRUST_SNAPSHOT_BACKLOG`` messages (default
30,000; the long run uses 200,000); each trial sends CreateSnapshot, SIGKILLs the server at a fraction of
the time a CreateSnapshot takes, restarts it, retries the CreateSnapshot as a client would (ALREADY_EXISTS
counts as done), and Seeks a subscription that holds nothing to the snapshot: it must then hold the whole
backlog.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.pubsub_v1.types import pubsub as types

from .conftest import Rpc, ServerProcess

BACKLOG = int(os.environ.get("HEDGEPUB_TRUST_SNAPSHOT_BACKLOG", "") or 30_000)
PROJECT = "projects/snapshot-crash"
TOPIC = f"{PROJECT}/topics/backlog"
SOURCE = f"{PROJECT}/subscriptions/source"
PROBE = f"{PROJECT}/subscriptions/probe"

Topic = types.Topic.pb()
Subscription = types.Subscription.pb()
Snapshot = types.Snapshot.pb()
PublishRequest = types.PublishRequest.pb()
PublishResponse = types.PublishResponse.pb()
CreateSnapshotRequest = types.CreateSnapshotRequest.pb()
DeleteSnapshotRequest = types.DeleteSnapshotRequest.pb()
SeekRequest = types.SeekRequest.pb()
SeekResponse = types.SeekResponse.pb()
PullRequest = types.PullRequest.pb()
PullResponse = types.PullResponse.pb()
AcknowledgeRequest = types.AcknowledgeRequest.pb()
Empty = empty_pb2.Empty


def _create_snapshot(rpc: Rpc, name: str) -> None:
    try:
        request = CreateSnapshotRequest(name=name, subscription=SOURCE)
        rpc.call("Subscriber", "CreateSnapshot", request, Snapshot, 120)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise


def _drain_count(rpc: Rpc, subscription: str) -> int:
    """Pull and acknowledge everything ``subscription`` holds; how many messages that was."""
    total = 0
    while True:
        request = PullRequest(subscription=subscription, max_messages=1000, return_immediately=True)
        pulled = rpc.call("Subscriber", "Pull", request, PullResponse, 60).received_messages
        if not pulled:
            return total
        total += len(pulled)
        ack = AcknowledgeRequest(subscription=subscription, ack_ids=[m.ack_id for m in pulled])
        rpc.call("Subscriber", "Acknowledge", ack, Empty, 60)


def test_a_snapshot_killed_while_being_taken_is_all_or_nothing(server_process: ServerProcess) -> None:
    server_process.start()
    rpc = Rpc(server_process.address)
    rpc.call("Publisher", "CreateTopic", Topic(name=TOPIC), Topic)
    source = Subscription(name=SOURCE, topic=TOPIC, ack_deadline_seconds=600)
    rpc.call("Subscriber", "CreateSubscription", source, Subscription)
    for start in range(0, BACKLOG, 1000):
        messages = [{"data": f"{index}".encode()} for index in range(start, min(BACKLOG, start + 1000))]
        rpc.call("Publisher", "Publish", PublishRequest(topic=TOPIC, messages=messages), PublishResponse, 60)
    probe = Subscription(name=PROBE, topic=TOPIC, ack_deadline_seconds=600)
    rpc.call("Subscriber", "CreateSubscription", probe, Subscription)
    # How long a whole CreateSnapshot takes here (then the kills fall inside it).
    started = time.monotonic()
    _create_snapshot(rpc, f"{PROJECT}/snapshots/timing")
    taking = time.monotonic() - started
    delete = DeleteSnapshotRequest(snapshot=f"{PROJECT}/snapshots/timing")
    rpc.call("Subscriber", "DeleteSnapshot", delete, Empty)
    rpc.close()
    for trial, fraction in enumerate((0.2, 0.4, 0.6, 0.8)):
        name = f"{PROJECT}/snapshots/trial-{trial}"
        rpc = Rpc(server_process.address)
        sender = threading.Thread(target=_ignore_errors, args=(_create_snapshot, rpc, name), daemon=True)
        sender.start()
        time.sleep(taking * fraction)
        server_process.kill()
        sender.join(30)
        rpc.close()
        server_process.start()
        rpc = Rpc(server_process.address)
        _create_snapshot(rpc, name)  # the client's retry
        rpc.call("Subscriber", "Seek", SeekRequest(subscription=PROBE, snapshot=name), SeekResponse, 120)
        held = _drain_count(rpc, PROBE)
        rpc.close()
        assert held == BACKLOG, (
            f"trial {trial} (kill at {fraction:.0%} of {taking:.2f} s): {held} of {BACKLOG}"
        )


def _ignore_errors(function: Any, *args: Any) -> None:
    with contextlib.suppress(grpc.RpcError):  # the server was killed under it
        function(*args)
