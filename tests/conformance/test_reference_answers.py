"""Answers the reference documents, checked on both servers where Google's emulator gives them too.

- ``DeadLetterPolicy.dead_letter_topic``: "The operation will fail if the topic does not exist":
  NOT_FOUND on CreateSubscription and on an UpdateSubscription that sets the policy (both servers);
- GetIamPolicy of a resource nobody set a policy on: the empty policy Google's services answer
  (``etag: ACAB``, version 0, no bindings); SetIamPolicy refuses unknown roles and members not of IAM's
  ``<type>:<value>`` form with INVALID_ARGUMENT, whether IAM is enforced or not (the emulator answers
  UNIMPLEMENTED to both: local server only);
- attribute keys must not begin with ``goog`` in any case (the emulator takes ``GOOGfoo``: local
  server only);
- an ack ID of another subscription: INVALID_ARGUMENT, as the real service ("You have passed a
  subscription that does not belong to the given ack ID") and the emulator answer (both servers).
"""

from __future__ import annotations

import base64
import http.client
import json
from typing import Any

import grpc
import pytest
from google.iam.v1 import iam_policy_pb2, policy_pb2
from google.pubsub_v1.types import pubsub as types

from .._pb import (
    AcknowledgeRequest,
    ModifyAckDeadlineRequest,
    PublishRequest,
    PubsubMessage,
    PullRequest,
    Subscription,
    Topic,
    UpdateSubscriptionRequest,
)
from .conftest import Target

DeleteTopicRequest: Any = types.DeleteTopicRequest.pb()
DeleteSubscriptionRequest: Any = types.DeleteSubscriptionRequest.pb()


def _rest(address: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        payload = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=payload, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


# ------------------------------------------------------------------------------------ dead letters
def test_a_dead_letter_topic_that_does_not_exist_is_not_found(target: Target) -> None:
    topic = target.name("topics", "source")
    target.call("CreateTopic", Topic(name=topic))
    missing = target.name("topics", "never-created")
    subscription = Subscription(name=target.name("subscriptions", "dead"), topic=topic)
    subscription.dead_letter_policy.dead_letter_topic = missing
    error = target.error("CreateSubscription", subscription)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        target.call("GetSubscription", subscription)  # nothing was created
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    plain = Subscription(name=target.name("subscriptions", "plain"), topic=topic)
    target.call("CreateSubscription", plain)
    update = UpdateSubscriptionRequest(subscription=Subscription(name=plain.name))
    update.subscription.dead_letter_policy.dead_letter_topic = missing
    update.update_mask.paths.append("dead_letter_policy")
    assert target.error("UpdateSubscription", update).code() == grpc.StatusCode.NOT_FOUND
    stored = target.call("GetSubscription", plain)
    assert not stored.HasField("dead_letter_policy")

    # Once the topic exists, both go through.
    target.call("CreateTopic", Topic(name=missing))
    assert target.call("UpdateSubscription", update).dead_letter_policy.dead_letter_topic == missing
    assert target.call("CreateSubscription", subscription).dead_letter_policy.dead_letter_topic == missing


def test_a_dead_letter_topic_deleted_later_does_not_block_other_updates(hedgepub_target: Target) -> None:
    target = hedgepub_target
    topic, dead = target.name("topics", "source"), target.name("topics", "dead")
    for name in (topic, dead):
        target.call("CreateTopic", Topic(name=name))
    subscription = Subscription(name=target.name("subscriptions", "sub"), topic=topic)
    subscription.dead_letter_policy.dead_letter_topic = dead
    target.call("CreateSubscription", subscription)
    target.call("DeleteTopic", DeleteTopicRequest(topic=dead))
    changed = Subscription(name=subscription.name, ack_deadline_seconds=30)
    update = UpdateSubscriptionRequest(subscription=changed)
    update.update_mask.paths.append("ack_deadline_seconds")
    assert target.call("UpdateSubscription", update).ack_deadline_seconds == 30


def test_a_missing_dead_letter_topic_is_not_found_over_rest(hedgepub_target: Target) -> None:
    target = hedgepub_target
    topic = target.name("topics", "source")
    target.call("CreateTopic", Topic(name=topic))
    name = target.name("subscriptions", "rest-dead")
    body = {"topic": topic, "deadLetterPolicy": {"deadLetterTopic": target.name("topics", "none")}}
    status, answer = _rest(target.address, "PUT", f"/v1/{name}", body)
    assert (status, answer["error"]["status"]) == (404, "NOT_FOUND")
    status, _ = _rest(target.address, "PUT", f"/v1/{name}", {"topic": topic})
    assert status == 200
    patch = {"subscription": body, "updateMask": "deadLetterPolicy"}
    status, answer = _rest(target.address, "PATCH", f"/v1/{name}", patch)
    assert (status, answer["error"]["status"]) == (404, "NOT_FOUND")


# ------------------------------------------------------------------------------------------ IAM
EMPTY_ETAG = base64.b64decode("ACAB")


def test_the_policy_of_a_resource_nobody_set_one_on_is_the_empty_policy(hedgepub_target: Target) -> None:
    target = hedgepub_target
    topic = target.name("topics", "unguarded")
    target.call("CreateTopic", Topic(name=topic))
    policy = target.call("GetIamPolicy", iam_policy_pb2.GetIamPolicyRequest(resource=topic))
    assert (policy.version, list(policy.bindings), policy.etag) == (0, [], EMPTY_ETAG)
    # Read-modify-write from the empty policy goes through with its etag, as with any other.
    binding = policy_pb2.Binding(role="roles/pubsub.publisher", members=["user:alice@example.com"])
    policy.bindings.append(binding)
    written = target.call("SetIamPolicy", iam_policy_pb2.SetIamPolicyRequest(resource=topic, policy=policy))
    assert (written.version, written.bindings[0].role) == (1, "roles/pubsub.publisher")
    assert written.etag != EMPTY_ETAG
    # Over REST: the etag is base64 ("ACAB"), the version 0 is left out as proto3 JSON does.
    status, answer = _rest(target.address, "GET", f"/v1/{target.name('topics', 'x')}:getIamPolicy")
    assert status == 404
    other = target.name("topics", "rest")
    target.call("CreateTopic", Topic(name=other))
    status, answer = _rest(target.address, "GET", f"/v1/{other}:getIamPolicy")
    assert (status, answer) == (200, {"etag": "ACAB"})


BAD_BINDINGS = [
    ("roles/not.a.role", "user:alice@example.com", "Role roles/not.a.role is not supported"),
    ("pubsub.publisher", "user:alice@example.com", "Role pubsub.publisher is not supported"),
    ("roles/pubsub.publisher", "bogus", "Policy members must be of the form"),
    ("roles/pubsub.publisher", "user:", "Policy members must be of the form"),
    ("roles/pubsub.publisher", "user:alice", "Policy members must be of the form"),
    ("roles/pubsub.publisher", "robot:alice@example.com", "Policy members must be of the form"),
    ("roles/pubsub.publisher", "domain:", "Policy members must be of the form"),
]


@pytest.mark.parametrize(("role", "member", "said"), BAD_BINDINGS)
def test_set_iam_policy_refuses_unknown_roles_and_malformed_members(
    hedgepub_target: Target, role: str, member: str, said: str
) -> None:
    target = hedgepub_target
    topic = target.name("topics", "guarded")
    target.call("CreateTopic", Topic(name=topic))
    policy = policy_pb2.Policy(bindings=[policy_pb2.Binding(role=role, members=[member])])
    error = target.error("SetIamPolicy", iam_policy_pb2.SetIamPolicyRequest(resource=topic, policy=policy))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert said in error.details()
    # Nothing was stored.
    stored = target.call("GetIamPolicy", iam_policy_pb2.GetIamPolicyRequest(resource=topic))
    assert list(stored.bindings) == []
    status, answer = _rest(
        target.address,
        "POST",
        f"/v1/{topic}:setIamPolicy",
        {"policy": {"bindings": [{"role": role, "members": [member]}]}},
    )
    assert (status, answer["error"]["status"]) == (400, "INVALID_ARGUMENT")


@pytest.mark.parametrize(
    "member",
    ["user:alice@example.com", "serviceAccount:sa@p.iam.gserviceaccount.com", "group:g@example.com",
     "domain:example.com", "allUsers", "allAuthenticatedUsers", "deleted:user:bob@example.com?uid=123"],
)  # fmt: skip
def test_set_iam_policy_takes_every_member_kind_it_knows(hedgepub_target: Target, member: str) -> None:
    target = hedgepub_target
    topic = target.name("topics", "guarded")
    target.call("CreateTopic", Topic(name=topic))
    policy = policy_pb2.Policy(bindings=[policy_pb2.Binding(role="roles/pubsub.viewer", members=[member])])
    written = target.call("SetIamPolicy", iam_policy_pb2.SetIamPolicyRequest(resource=topic, policy=policy))
    assert list(written.bindings[0].members) == [member]


# ---------------------------------------------------------------------------------- attributes
@pytest.mark.parametrize("key", ["GOOGfoo", "Goog", "gOOg_x"])
def test_attribute_keys_beginning_with_goog_in_any_case_are_refused(
    hedgepub_target: Target, key: str
) -> None:
    target = hedgepub_target
    topic = target.name("topics", "attrs")
    target.call("CreateTopic", Topic(name=topic))
    request = PublishRequest(topic=topic, messages=[PubsubMessage(data=b"x", attributes={key: "v"})])
    error = target.error("Publish", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = {"messages": [{"data": "eA==", "attributes": {key: "v"}}]}
    status, answer = _rest(target.address, "POST", f"/v1/{topic}:publish", body)
    assert (status, answer["error"]["status"]) == (400, "INVALID_ARGUMENT")


# ---------------------------------------------------------------------------------------- ack IDs
def test_an_ack_id_of_another_subscription_is_invalid(target: Target) -> None:
    topic = target.name("topics", "acks")
    target.call("CreateTopic", Topic(name=topic))
    mine, other = target.name("subscriptions", "mine"), target.name("subscriptions", "other")
    for name in (mine, other):
        target.call("CreateSubscription", Subscription(name=name, topic=topic))
    target.call("Publish", PublishRequest(topic=topic, messages=[PubsubMessage(data=b"m")]))
    (received,) = target.call("Pull", PullRequest(subscription=mine, max_messages=1)).received_messages
    for method, request in (
        ("Acknowledge", AcknowledgeRequest(subscription=other, ack_ids=[received.ack_id])),
        ("ModifyAckDeadline", ModifyAckDeadlineRequest(subscription=other, ack_ids=[received.ack_id])),
    ):
        assert target.error(method, request).code() == grpc.StatusCode.INVALID_ARGUMENT, method
    # On its own subscription it acknowledges, and the message is gone from there only.
    target.call("Acknowledge", AcknowledgeRequest(subscription=mine, ack_ids=[received.ack_id]))
    (still,) = target.call("Pull", PullRequest(subscription=other, max_messages=1)).received_messages
    assert still.message.data == b"m"


def test_an_ack_id_of_a_deleted_subscription_is_invalid_on_its_successor(hedgepub_target: Target) -> None:
    """As the real service answers a client that acks after its subscription was deleted and re-created."""
    target = hedgepub_target
    topic, name = target.name("topics", "acks"), target.name("subscriptions", "again")
    target.call("CreateTopic", Topic(name=topic))
    target.call("CreateSubscription", Subscription(name=name, topic=topic))
    target.call("Publish", PublishRequest(topic=topic, messages=[PubsubMessage(data=b"m")]))
    (received,) = target.call("Pull", PullRequest(subscription=name, max_messages=1)).received_messages
    target.call("DeleteSubscription", DeleteSubscriptionRequest(subscription=name))
    target.call("CreateSubscription", Subscription(name=name, topic=topic))
    error = target.error("Acknowledge", AcknowledgeRequest(subscription=name, ack_ids=[received.ack_id]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"does not belong to the given ack ID (resource={name})" in error.details()
