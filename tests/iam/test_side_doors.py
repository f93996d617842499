"""IAM side doors under enforcement: dead-letter forwarding, and answers that would reveal what exists.

- Dead-letter forwarding publishes as the service's own forwarding identity
  (``serviceAccount:service-{project}@gcp-sa-pubsub.iam.gserviceaccount.com``, the project ID standing in
  for the real service's project number), so the dead-letter topic must grant it publishing: otherwise
  Create/UpdateSubscription refuse the policy (PERMISSION_DENIED), and a grant withdrawn later stops the
  forwarding (the message stays for redelivery).
- Every RPC checks the caller before looking anything up: with no token, or no roles, TestIamPermissions
  answers the same for a topic that exists and one that does not.

Through the official Python clients, with a bearer token per call.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.iam.v1 import iam_policy_pb2, policy_pb2
from google.protobuf import field_mask_pb2

from hedgepub.server import IamConfig, LocalServer

PROJECT = "projects/doors"
SOURCE = f"{PROJECT}/topics/orders"
PROTECTED = f"{PROJECT}/topics/payments"
#: the documented forwarding identity of project "doors" (written out, not taken from the server's code)
FORWARDER = "serviceAccount:service-doors@gcp-sa-pubsub.iam.gserviceaccount.com"

TOKENS = {
    "t-admin": "user:admin@example.com",
    "t-mallory": "user:mallory@example.com",
    "t-nobody": "user:nobody@example.com",
    "t-viewer": "user:viewer@example.com",
}
POLICY = {
    "bindings": [
        {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
        {"role": "roles/pubsub.viewer", "members": ["user:viewer@example.com"]},
    ]
}


def _as(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


ADMIN = _as("t-admin")


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, LocalServer]]:
    with LocalServer(in_memory=True, iam=IamConfig(TOKENS, POLICY)) as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        publisher.create_topic(name=SOURCE, metadata=ADMIN)
        publisher.create_topic(name=PROTECTED, metadata=ADMIN)
        try:
            yield publisher, subscriber, server
        finally:
            subscriber.close()


def _grant(publisher: Any, topic: str, bindings: dict[str, list[str]]) -> None:
    policy = policy_pb2.Policy(bindings=[policy_pb2.Binding(role=r, members=m) for r, m in bindings.items()])
    publisher.set_iam_policy(request={"resource": topic, "policy": policy}, metadata=ADMIN)


def _subscription(name: str, dead_letter_topic: str) -> dict[str, Any]:
    return {
        "name": f"{PROJECT}/subscriptions/{name}",
        "topic": SOURCE,
        "dead_letter_policy": {"dead_letter_topic": dead_letter_topic, "max_delivery_attempts": 5},
    }


def _nack_until_forwarded_or(subscriber: Any, subscription: str, rounds: int) -> list[int]:
    """Pull and nack ``rounds`` times; the delivery attempts seen (empty pulls end early)."""
    attempts = []
    for _ in range(rounds):
        response = subscriber.pull(
            request={"subscription": subscription, "max_messages": 10}, metadata=ADMIN, timeout=1.5
        )
        if not response.received_messages:
            break
        attempts += [received.delivery_attempt for received in response.received_messages]
        subscriber.modify_ack_deadline(
            request={
                "subscription": subscription,
                "ack_ids": [received.ack_id for received in response.received_messages],
                "ack_deadline_seconds": 0,
            },
            metadata=ADMIN,
        )
    return attempts


# ------------------------------------------------------------------------------------------- dead letters
def test_a_dead_letter_topic_that_does_not_grant_the_forwarder_is_refused_on_create(clients) -> None:
    _, subscriber, _ = clients
    # even the admin, who may publish to it: the service forwards as itself, not as the caller
    with pytest.raises(exceptions.PermissionDenied, match="User not authorized to perform this action"):
        subscriber.create_subscription(request=_subscription("audit", PROTECTED), metadata=ADMIN)
    with pytest.raises(exceptions.NotFound):
        subscriber.get_subscription(subscription=f"{PROJECT}/subscriptions/audit", metadata=ADMIN)


def test_a_subscriber_cannot_route_its_messages_to_a_protected_topic_by_update(clients) -> None:
    publisher, subscriber, _ = clients
    name = f"{PROJECT}/subscriptions/mallory-sub"
    subscriber.create_subscription(request={"name": name, "topic": SOURCE}, metadata=ADMIN)
    # mallory may update and consume her own subscription, and nothing else
    _grant(publisher, name, {"roles/pubsub.editor": ["user:mallory@example.com"]})
    update = {
        "subscription": {
            "name": name,
            "dead_letter_policy": {"dead_letter_topic": PROTECTED, "max_delivery_attempts": 5},
        },
        "update_mask": field_mask_pb2.FieldMask(paths=["dead_letter_policy"]),
    }
    with pytest.raises(exceptions.PermissionDenied):
        subscriber.update_subscription(request=update, metadata=_as("t-mallory"))
    assert not subscriber.get_subscription(
        subscription=name, metadata=ADMIN
    ).dead_letter_policy.dead_letter_topic


def _publish(publisher: Any, data: bytes) -> None:
    # the batching publish() takes no per-call metadata; the generated method underneath does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "api" is kept for this, with a warning
        publisher.api.publish(request={"topic": SOURCE, "messages": [{"data": data}]}, metadata=ADMIN)


def test_forwarding_works_where_granted(clients, wait_for) -> None:
    publisher, subscriber, server = clients
    _grant(publisher, PROTECTED, {"roles/pubsub.publisher": [FORWARDER]})
    subscription = subscriber.create_subscription(request=_subscription("audit", PROTECTED), metadata=ADMIN)
    _publish(publisher, b"poison")
    assert _nack_until_forwarded_or(subscriber, subscription.name, 10) == [1, 2, 3, 4, 5]
    assert wait_for(lambda: [m.data for m in server.messages(PROTECTED)] == [b"poison"], timeout=5.0)


def test_a_withdrawn_grant_stops_forwarding_and_keeps_the_message(clients) -> None:
    publisher, subscriber, server = clients
    _grant(publisher, PROTECTED, {"roles/pubsub.publisher": [FORWARDER]})
    subscription = subscriber.create_subscription(request=_subscription("audit", PROTECTED), metadata=ADMIN)
    _grant(publisher, PROTECTED, {})  # the topic's owner takes the grant back
    _publish(publisher, b"poison")
    attempts = _nack_until_forwarded_or(subscriber, subscription.name, 8)
    assert attempts == [1, 2, 3, 4, 5, 6, 7, 8]  # never forwarded: delivered again and again
    assert server.messages(PROTECTED) == []


# ------------------------------------------------------------------------------------ TestIamPermissions
def _test_permissions(publisher: Any, topic: str, token: str | None) -> list[str] | str:
    request = iam_policy_pb2.TestIamPermissionsRequest(
        resource=topic, permissions=["pubsub.topics.get", "pubsub.topics.publish"]
    )
    try:
        return list(publisher.test_iam_permissions(request=request, metadata=_as(token)).permissions)
    except exceptions.GoogleAPICallError as error:
        return type(error).__name__


@pytest.mark.parametrize("token", [None, "t-unknown", "t-nobody"])
def test_test_iam_permissions_does_not_tell_a_stranger_what_exists(clients, token) -> None:
    publisher, _, _ = clients
    existing = _test_permissions(publisher, SOURCE, token)
    missing = _test_permissions(publisher, f"{PROJECT}/topics/no-such-topic", token)
    assert existing == missing
    expected = "Unauthenticated" if token in (None, "t-unknown") else []
    assert existing == expected


def test_test_iam_permissions_answers_a_caller_with_access(clients) -> None:
    publisher, _, _ = clients
    assert _test_permissions(publisher, SOURCE, "t-viewer") == ["pubsub.topics.get"]
    assert _test_permissions(publisher, f"{PROJECT}/topics/no-such-topic", "t-viewer") == "NotFound"
