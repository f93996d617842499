"""IAM enforcement on the in-process server: raw gRPC and hedgepub's publisher, one principal per role.

Every expectation below is written from the real service's documentation (which permission each RPC
needs, which role holds it), not derived from the server's own tables, so a wrong table fails a test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest
from google.iam.v1 import iam_policy_pb2, policy_pb2
from google.pubsub_v1.types import pubsub as types
from google.pubsub_v1.types import schema as schema_types

from hedgepub._status import StatusCode
from hedgepub.server import IamConfig, LocalServer, ServiceError
from hedgepub.server._iam.iam import IamEnforcer
from hedgepub.server._methods import RPCS

PROJECT = "projects/iam-project"
OTHER_PROJECT = "projects/other-project"

#: Role -> the principal holding it on every project (through the project-level policy).
ROLE_HOLDERS: dict[str, str] = {
    "roles/pubsub.publisher": "serviceAccount:ci@iam-project.iam.gserviceaccount.com",
    "roles/pubsub.subscriber": "user:subscriber@example.com",
    "roles/pubsub.viewer": "user:viewer@example.com",
    "roles/pubsub.editor": "user:editor@example.com",
    "roles/pubsub.admin": "user:admin@example.com",
    "roles/owner": "user:owner@example.com",
    "roles/editor": "user:basic-editor@example.com",
    "roles/viewer": "group:auditors@example.com",
}
#: Token of each role's holder; "t-nobody" is a known caller who holds no role at all.
TOKENS: dict[str, Any] = {f"t-{role.rsplit('/', 1)[1]}": holder for role, holder in ROLE_HOLDERS.items()}
TOKENS["t-nobody"] = "user:nobody@example.com"
# A user who is in the auditors group: bindings naming the group apply to them.
TOKENS["t-auditor"] = ["user:ann@example.com", "group:auditors@example.com"]
TOKENS["t-partner"] = "user:pat@partner.example"
POLICY: dict[str, Any] = {
    "bindings": [
        {
            "role": role,
            "members": [holder, "domain:partner.example"] if role == "roles/pubsub.viewer" else [holder],
        }
        for role, holder in ROLE_HOLDERS.items()
    ]
}


def token_of(role: str) -> str:
    """The token of the principal holding ``role`` on the project."""
    return f"t-{role.rsplit('/', 1)[1]}"


ADMIN = token_of("roles/pubsub.admin")

AVRO = '{"type": "record", "name": "Event", "fields": [{"name": "id", "type": "int"}]}'


class Caller:
    """Raw gRPC calls to the server, each with an optional bearer token."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self._names = itertools.count()

    @staticmethod
    def metadata(token: str | None) -> list[tuple[str, str]]:
        return [] if token is None else [("authorization", f"Bearer {token}")]

    def call(self, method: str, request: Any, token: str | None = None, timeout: float = 10.0) -> Any:
        """Call ``method`` (short name); raises ``grpc.RpcError``."""
        stub = self.channel.unary_unary(
            RPCS[method].path,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=RPCS[method].response_class.FromString,
        )
        return stub(request, timeout=timeout, metadata=self.metadata(token))

    def stream(self, requests: Sequence[Any], token: str | None = None, timeout: float = 5.0) -> Any:
        """Open StreamingPull with ``requests`` and return its first response; raises ``grpc.RpcError``."""
        stub = self.channel.stream_stream(
            "/google.pubsub.v1.Subscriber/StreamingPull",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=types.StreamingPullResponse.pb().FromString,
        )
        call = stub(iter(requests), timeout=timeout, metadata=self.metadata(token))
        try:
            return next(call)
        finally:
            call.cancel()

    def code_of(self, method: str, request: Any, token: str | None) -> grpc.StatusCode:
        """The status code ``method`` answers with (OK on success)."""
        try:
            if method == "StreamingPull":
                self.stream([request], token)
            else:
                self.call(method, request, token)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def unique(self, prefix: str) -> str:
        """A fresh resource ID."""
        return f"{prefix}-{next(self._names)}"

    # ---- setup as the admin
    def create_topic(self, topic_id: str | None = None, project: str = PROJECT) -> str:
        name = f"{project}/topics/{topic_id or self.unique('topic')}"
        self.call("CreateTopic", types.Topic.pb()(name=name), ADMIN)
        return name

    def create_subscription(self, topic: str, subscription_id: str | None = None) -> str:
        project = topic.split("/topics/")[0]
        name = f"{project}/subscriptions/{subscription_id or self.unique('sub')}"
        self.call("CreateSubscription", types.Subscription.pb()(name=name, topic=topic), ADMIN)
        return name

    def publish(self, topic: str, data: bytes = b"payload", token: str = ADMIN) -> list[str]:
        request = types.PublishRequest.pb()(topic=topic, messages=[types.PubsubMessage.pb()(data=data)])
        return list(self.call("Publish", request, token).message_ids)

    def create_schema(self) -> Any:
        """A new Avro schema with two revisions (so that one can be deleted); returns the latest."""
        schema = schema_types.Schema.pb()(type_=schema_types.Schema.Type.AVRO, definition=AVRO)
        request = schema_types.CreateSchemaRequest.pb()(
            parent=PROJECT, schema=schema, schema_id=self.unique("schema")
        )
        created = self.call("CreateSchema", request, ADMIN)
        commit = schema_types.CommitSchemaRequest.pb()(name=created.name, schema=schema)
        return self.call("CommitSchema", commit, ADMIN)

    def set_policy(self, resource: str, bindings: dict[str, list[str]], token: str = ADMIN) -> Any:
        policy = policy_pb2.Policy(
            bindings=[policy_pb2.Binding(role=role, members=members) for role, members in bindings.items()]
        )
        request = iam_policy_pb2.SetIamPolicyRequest(resource=resource, policy=policy)
        return self.call("SetIamPolicy", request, token)

    def test_permissions(self, resource: str, permissions: list[str], token: str | None) -> list[str]:
        request = iam_policy_pb2.TestIamPermissionsRequest(resource=resource, permissions=permissions)
        return list(self.call("TestIamPermissions", request, token).permissions)

    def close(self) -> None:
        self.channel.close()


def iam_config() -> IamConfig:
    """The tokens and project policy every IAM test server starts with."""
    return IamConfig(TOKENS, POLICY)


@pytest.fixture(scope="module")
def iam_server() -> Iterator[LocalServer]:
    """An in-memory server enforcing IAM (module scope: tests use fresh resource names)."""
    with LocalServer(in_memory=True, iam=iam_config()) as server:
        yield server


@pytest.fixture(scope="module")
def caller(iam_server: LocalServer) -> Iterator[Caller]:
    """Raw gRPC calls to :func:`iam_server`."""
    caller = Caller(iam_server.address)
    yield caller
    caller.close()


# ------------------------------------------------------------------------------------------------ tests
UNAUTHENTICATED_START = "Request had invalid authentication credentials. Expected OAuth 2 access token"
MISSING_START = "Request is missing required authentication credential. Expected OAuth 2 access token"
DENIED = "User not authorized to perform this action."

TOPIC_ALL = [
    "pubsub.topics.attachSubscription",
    "pubsub.topics.delete",
    "pubsub.topics.detachSubscription",
    "pubsub.topics.get",
    "pubsub.topics.getIamPolicy",
    "pubsub.topics.publish",
    "pubsub.topics.setIamPolicy",
    "pubsub.topics.update",
]
SUBSCRIPTION_ALL = [
    "pubsub.subscriptions.consume",
    "pubsub.subscriptions.delete",
    "pubsub.subscriptions.get",
    "pubsub.subscriptions.getIamPolicy",
    "pubsub.subscriptions.setIamPolicy",
    "pubsub.subscriptions.update",
]


def _expect(error: grpc.RpcError, code: grpc.StatusCode, message_start: str) -> None:
    assert error.code() == code, (error.code(), error.details())
    assert error.details().startswith(message_start), error.details()


def sample_request(method: str, caller: Caller) -> Any:
    """A valid request for ``method`` on fresh resources (created by the admin), as a client would send."""
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    mask = {"update_mask": {"paths": ["labels"]}}
    builders: dict[str, Any] = {
        "CreateTopic": lambda: types.Topic.pb()(name=f"{PROJECT}/topics/{caller.unique('new')}"),
        "GetTopic": lambda: types.GetTopicRequest.pb()(topic=topic),
        "UpdateTopic": lambda: types.UpdateTopicRequest.pb()(
            topic=types.Topic.pb()(name=topic, labels={"team": "a"}), **mask
        ),
        "ListTopics": lambda: types.ListTopicsRequest.pb()(project=PROJECT),
        "ListTopicSubscriptions": lambda: types.ListTopicSubscriptionsRequest.pb()(topic=topic),
        "DeleteTopic": lambda: types.DeleteTopicRequest.pb()(topic=topic),
        "DetachSubscription": lambda: types.DetachSubscriptionRequest.pb()(subscription=subscription),
        "Publish": lambda: types.PublishRequest.pb()(
            topic=topic, messages=[types.PubsubMessage.pb()(data=b"hello")]
        ),
        "CreateSubscription": lambda: types.Subscription.pb()(
            name=f"{PROJECT}/subscriptions/{caller.unique('new')}", topic=topic
        ),
        "GetSubscription": lambda: types.GetSubscriptionRequest.pb()(subscription=subscription),
        "UpdateSubscription": lambda: types.UpdateSubscriptionRequest.pb()(
            subscription=types.Subscription.pb()(name=subscription, topic=topic, labels={"team": "a"}), **mask
        ),
        "ModifyPushConfig": lambda: types.ModifyPushConfigRequest.pb()(
            subscription=subscription, push_config=types.PushConfig.pb()()
        ),
        "ListSubscriptions": lambda: types.ListSubscriptionsRequest.pb()(project=PROJECT),
        "DeleteSubscription": lambda: types.DeleteSubscriptionRequest.pb()(subscription=subscription),
        "Pull": lambda: types.PullRequest.pb()(
            subscription=subscription, max_messages=1, return_immediately=True
        ),
        "Acknowledge": lambda: types.AcknowledgeRequest.pb()(
            subscription=subscription, ack_ids=["0badc0de-1"]
        ),
        "ModifyAckDeadline": lambda: types.ModifyAckDeadlineRequest.pb()(
            subscription=subscription, ack_ids=["0badc0de-1"], ack_deadline_seconds=30
        ),
        "StreamingPull": lambda: types.StreamingPullRequest.pb()(
            subscription=subscription, stream_ack_deadline_seconds=10
        ),
        "GetIamPolicy": lambda: iam_policy_pb2.GetIamPolicyRequest(resource=topic),
        "SetIamPolicy": lambda: iam_policy_pb2.SetIamPolicyRequest(
            resource=subscription, policy=policy_pb2.Policy()
        ),
        "TestIamPermissions": lambda: iam_policy_pb2.TestIamPermissionsRequest(
            resource=topic, permissions=["pubsub.topics.get"]
        ),
    }
    if method.endswith(("Schema", "Schemas", "SchemaRevisions", "SchemaRevision", "Message")):
        builders.update(_schema_requests(caller))
    if "Snapshot" in method or method == "Seek":
        builders.update(_snapshot_requests(caller, topic, subscription))
    if method == "StreamingPull":
        caller.publish(topic)  # so that an allowed stream answers at once
    return builders[method]()


def _snapshot_requests(caller: Caller, topic: str, subscription: str) -> dict[str, Any]:
    """Builders of valid snapshot and Seek requests on a fresh snapshot (taken by the admin)."""
    snapshot = f"{PROJECT}/snapshots/{caller.unique('snapshot')}"
    request = types.CreateSnapshotRequest.pb()(name=snapshot, subscription=subscription)
    caller.call("CreateSnapshot", request, ADMIN)
    return {
        "CreateSnapshot": lambda: types.CreateSnapshotRequest.pb()(
            name=f"{PROJECT}/snapshots/{caller.unique('new')}", subscription=subscription
        ),
        "GetSnapshot": lambda: types.GetSnapshotRequest.pb()(snapshot=snapshot),
        "ListSnapshots": lambda: types.ListSnapshotsRequest.pb()(project=PROJECT),
        "UpdateSnapshot": lambda: types.UpdateSnapshotRequest.pb()(
            snapshot=types.Snapshot.pb()(name=snapshot, labels={"team": "a"}),
            update_mask={"paths": ["labels"]},
        ),
        "DeleteSnapshot": lambda: types.DeleteSnapshotRequest.pb()(snapshot=snapshot),
        "Seek": lambda: types.SeekRequest.pb()(subscription=subscription, snapshot=snapshot),
        "ListTopicSnapshots": lambda: types.ListTopicSnapshotsRequest.pb()(topic=topic),
    }


def _schema_requests(caller: Caller) -> dict[str, Any]:
    """Builders of valid SchemaService requests on a fresh schema (created by the admin)."""
    latest = caller.create_schema()
    name = latest.name
    avro = schema_types.Schema.pb()(type_=schema_types.Schema.Type.AVRO, definition=AVRO)
    return {
        "CreateSchema": lambda: schema_types.CreateSchemaRequest.pb()(
            parent=PROJECT, schema=avro, schema_id=caller.unique("new")
        ),
        "GetSchema": lambda: schema_types.GetSchemaRequest.pb()(name=name),
        "ListSchemas": lambda: schema_types.ListSchemasRequest.pb()(parent=PROJECT),
        "ListSchemaRevisions": lambda: schema_types.ListSchemaRevisionsRequest.pb()(name=name),
        "CommitSchema": lambda: schema_types.CommitSchemaRequest.pb()(name=name, schema=avro),
        "RollbackSchema": lambda: schema_types.RollbackSchemaRequest.pb()(
            name=name, revision_id=latest.revision_id
        ),
        "DeleteSchemaRevision": lambda: schema_types.DeleteSchemaRevisionRequest.pb()(
            name=f"{name}@{latest.revision_id}"
        ),
        "DeleteSchema": lambda: schema_types.DeleteSchemaRequest.pb()(name=name),
        "ValidateSchema": lambda: schema_types.ValidateSchemaRequest.pb()(parent=PROJECT, schema=avro),
        "ValidateMessage": lambda: schema_types.ValidateMessageRequest.pb()(
            parent=PROJECT, name=name, message=b'{"id": 1}', encoding=schema_types.Encoding.JSON
        ),
    }


ALL_METHODS = sorted(RPCS)
_VIEW = {
    "GetTopic",
    "ListTopics",
    "ListTopicSubscriptions",
    "GetSubscription",
    "ListSubscriptions",
    "GetSchema",
    "ListSchemas",
    "ListSchemaRevisions",
    "GetSnapshot",
    "ListSnapshots",
    "ListTopicSnapshots",
}
_CONSUME = {"Pull", "StreamingPull", "Acknowledge", "ModifyAckDeadline", "Seek"}
#: What each role may call, from the access-control documentation (TestIamPermissions needs nothing).
ALLOWED: dict[str, set[str]] = {
    "roles/pubsub.publisher": {"Publish", "TestIamPermissions"},
    "roles/pubsub.subscriber": _CONSUME | {"TestIamPermissions"},
    "roles/pubsub.viewer": _VIEW | {"TestIamPermissions"},
    "roles/pubsub.editor": set(ALL_METHODS) - {"GetIamPolicy", "SetIamPolicy"},
    "roles/pubsub.admin": set(ALL_METHODS),
    "roles/owner": set(ALL_METHODS),
    "roles/editor": set(ALL_METHODS) - {"SetIamPolicy"},
    "roles/viewer": _VIEW | {"GetIamPolicy", "TestIamPermissions"},
}


def test_every_method_has_a_permission_mapping() -> None:
    from hedgepub.server._iam import iam as _iam

    assert set(_iam.RPC_PERMISSIONS) == set(RPCS)
    for method, checks in _iam.RPC_PERMISSIONS.items():
        for check in checks:
            assert check.permission.startswith("pubsub.") or method.endswith("IamPolicy"), method


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_refuses_callers_without_a_valid_token(caller: Caller, method: str) -> None:
    request = sample_request(method, caller)
    assert caller.code_of(method, request, None) == grpc.StatusCode.UNAUTHENTICATED
    assert caller.code_of(method, request, "t-unknown") == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_is_checked_for_a_caller_without_roles(caller: Caller, method: str) -> None:
    code = caller.code_of(method, sample_request(method, caller), "t-nobody")
    expected = grpc.StatusCode.OK if method == "TestIamPermissions" else grpc.StatusCode.PERMISSION_DENIED
    assert code == expected


@pytest.mark.parametrize("role", sorted(ALLOWED))
def test_each_role_may_call_exactly_its_methods(caller: Caller, role: str) -> None:
    outcomes = {
        method: caller.code_of(method, sample_request(method, caller), token_of(role))
        for method in ALL_METHODS
    }
    allowed = {method for method, code in outcomes.items() if code != grpc.StatusCode.PERMISSION_DENIED}
    assert allowed == ALLOWED[role], outcomes
    # Allowed calls on valid requests succeed outright.
    assert {method: outcomes[method] for method in allowed} == dict.fromkeys(allowed, grpc.StatusCode.OK)


def test_missing_and_unknown_tokens_answer_in_the_real_words(caller: Caller) -> None:
    topic = caller.create_topic()
    request = types.GetTopicRequest.pb()(topic=topic)
    with pytest.raises(grpc.RpcError) as missing:
        caller.call("GetTopic", request, None)
    _expect(missing.value, grpc.StatusCode.UNAUTHENTICATED, MISSING_START)
    for bad in ("t-unknown", ""):
        with pytest.raises(grpc.RpcError) as unknown:
            caller.call("GetTopic", request, bad)
        _expect(unknown.value, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_START)
    stub = caller.channel.unary_unary(
        "/google.pubsub.v1.Publisher/GetTopic",
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=types.Topic.pb().FromString,
    )
    with pytest.raises(grpc.RpcError) as basic:
        stub(request, metadata=[("authorization", "Basic t-pubsub.admin")])
    _expect(basic.value, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_START)
    # The scheme is case-insensitive, as in HTTP.
    assert stub(request, metadata=[("authorization", f"bearer {ADMIN}")]).name == topic


def test_streaming_pull_checks_the_token_before_the_request(caller: Caller) -> None:
    nameless = types.StreamingPullRequest.pb()(stream_ack_deadline_seconds=10)
    with pytest.raises(grpc.RpcError) as missing:
        caller.stream([nameless], None)
    _expect(missing.value, grpc.StatusCode.UNAUTHENTICATED, MISSING_START)
    assert caller.code_of("StreamingPull", nameless, "t-unknown") == grpc.StatusCode.UNAUTHENTICATED
    # With a valid token, the bad request is what is refused.
    assert caller.code_of("StreamingPull", nameless, ADMIN) == grpc.StatusCode.INVALID_ARGUMENT


def test_set_iam_policy_refuses_an_unknown_role_in_the_real_words(caller: Caller) -> None:
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    for resource in (topic, subscription, caller.create_schema().name, _create_snapshot(caller)):
        with pytest.raises(grpc.RpcError) as refused:
            caller.set_policy(resource, {"roles/pubsub.superuser": ["user:nobody@example.com"]})
        _expect(
            refused.value,
            grpc.StatusCode.INVALID_ARGUMENT,
            "Role roles/pubsub.superuser is not supported for this resource.",
        )
        request = iam_policy_pb2.GetIamPolicyRequest(resource=resource)
        assert list(caller.call("GetIamPolicy", request, ADMIN).bindings) == []  # nothing was stored


def test_publisher_publishes_but_cannot_create_topics_or_pull(caller: Caller) -> None:
    publisher = token_of("roles/pubsub.publisher")
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    assert len(caller.publish(topic, token=publisher)) == 1
    with pytest.raises(grpc.RpcError) as create:
        caller.call("CreateTopic", types.Topic.pb()(name=f"{PROJECT}/topics/{caller.unique('p')}"), publisher)
    _expect(create.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    assert create.value.details() == DENIED
    pull = types.PullRequest.pb()(subscription=subscription, max_messages=5, return_immediately=True)
    with pytest.raises(grpc.RpcError) as pulled:
        caller.call("Pull", pull, publisher)
    _expect(pulled.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    with pytest.raises(grpc.RpcError) as streamed:
        caller.stream(
            [types.StreamingPullRequest.pb()(subscription=subscription, stream_ack_deadline_seconds=10)],
            publisher,
        )
    _expect(streamed.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    # The message is still there for a subscriber.
    received = caller.call("Pull", pull, token_of("roles/pubsub.subscriber")).received_messages
    assert [message.message.data for message in received] == [b"payload"]


def test_subscriber_pulls_and_acks_but_cannot_publish(caller: Caller) -> None:
    subscriber = token_of("roles/pubsub.subscriber")
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    caller.publish(topic, b"one")
    caller.publish(topic, b"two")
    pull = types.PullRequest.pb()(subscription=subscription, max_messages=1, return_immediately=True)
    first = caller.call("Pull", pull, subscriber).received_messages
    assert len(first) == 1
    caller.call(
        "Acknowledge",
        types.AcknowledgeRequest.pb()(subscription=subscription, ack_ids=[first[0].ack_id]),
        subscriber,
    )
    streamed = caller.stream(
        [types.StreamingPullRequest.pb()(subscription=subscription, stream_ack_deadline_seconds=10)],
        subscriber,
    )
    assert [message.message.data for message in streamed.received_messages] == [b"two"]
    with pytest.raises(grpc.RpcError) as published:
        caller.publish(topic, token=subscriber)
    _expect(published.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    # The subscriber role attaches subscriptions to topics, but creating one also needs
    # pubsub.subscriptions.create on the project.
    with pytest.raises(grpc.RpcError) as created:
        caller.call(
            "CreateSubscription",
            types.Subscription.pb()(name=f"{PROJECT}/subscriptions/{caller.unique('s')}", topic=topic),
            subscriber,
        )
    _expect(created.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)


def test_viewer_reads_but_cannot_modify(caller: Caller) -> None:
    viewer = token_of("roles/pubsub.viewer")
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    assert caller.call("GetTopic", types.GetTopicRequest.pb()(topic=topic), viewer).name == topic
    listed = caller.call("ListTopics", types.ListTopicsRequest.pb()(project=PROJECT, page_size=1000), viewer)
    assert topic in [t.name for t in listed.topics]
    got = caller.call("GetSubscription", types.GetSubscriptionRequest.pb()(subscription=subscription), viewer)
    assert got.topic == topic
    for method, request in (
        ("DeleteTopic", types.DeleteTopicRequest.pb()(topic=topic)),
        ("DeleteSubscription", types.DeleteSubscriptionRequest.pb()(subscription=subscription)),
        ("GetIamPolicy", iam_policy_pb2.GetIamPolicyRequest(resource=topic)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            caller.call(method, request, viewer)
        _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    with pytest.raises(grpc.RpcError) as published:
        caller.publish(topic, token=viewer)
    _expect(published.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)


def test_members_by_group_and_by_domain(caller: Caller) -> None:
    topic = caller.create_topic()
    # t-auditor's principals include group:auditors@example.com, which holds roles/viewer.
    policy = caller.call("GetIamPolicy", iam_policy_pb2.GetIamPolicyRequest(resource=topic), "t-auditor")
    assert list(policy.bindings) == []
    # domain:partner.example holds roles/pubsub.viewer: users of that domain may read, not publish.
    assert caller.call("GetTopic", types.GetTopicRequest.pb()(topic=topic), "t-partner").name == topic
    assert (
        caller.code_of("Publish", sample_request("Publish", caller), "t-partner")
        == grpc.StatusCode.PERMISSION_DENIED
    )


def test_topic_policy_grants_publish_on_that_topic_only(caller: Caller) -> None:
    granted_topic = caller.create_topic()
    other_topic = caller.create_topic()
    caller.set_policy(granted_topic, {"roles/pubsub.publisher": ["user:nobody@example.com"]})
    assert len(caller.publish(granted_topic, token="t-nobody")) == 1
    with pytest.raises(grpc.RpcError) as elsewhere:
        caller.publish(other_topic, token="t-nobody")
    _expect(elsewhere.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    # Publishing is all the binding grants, even on that topic.
    assert caller.code_of("GetTopic", types.GetTopicRequest.pb()(topic=granted_topic), "t-nobody") == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # The project policy is inherited: the project-wide publisher still publishes there.
    assert len(caller.publish(granted_topic, token=token_of("roles/pubsub.publisher"))) == 1
    # Removing the binding takes the grant back.
    caller.set_policy(granted_topic, {})
    assert (
        caller.code_of(
            "Publish",
            types.PublishRequest.pb()(topic=granted_topic, messages=[types.PubsubMessage.pb()(data=b"x")]),
            "t-nobody",
        )
        == grpc.StatusCode.PERMISSION_DENIED
    )


def test_subscription_policy_grants_consume_there_only(caller: Caller) -> None:
    topic = caller.create_topic()
    granted = caller.create_subscription(topic)
    other = caller.create_subscription(topic)
    caller.set_policy(granted, {"roles/pubsub.subscriber": ["user:nobody@example.com"]})
    caller.publish(topic)
    pull = types.PullRequest.pb()(subscription=granted, max_messages=1, return_immediately=True)
    assert len(caller.call("Pull", pull, "t-nobody").received_messages) == 1
    pull_other = types.PullRequest.pb()(subscription=other, max_messages=1, return_immediately=True)
    assert caller.code_of("Pull", pull_other, "t-nobody") == grpc.StatusCode.PERMISSION_DENIED
    # A resource policy cannot grant project permissions (creating subscriptions) even to a subscriber.
    create = types.Subscription.pb()(name=f"{PROJECT}/subscriptions/{caller.unique('x')}", topic=topic)
    assert caller.code_of("CreateSubscription", create, "t-nobody") == grpc.StatusCode.PERMISSION_DENIED


def test_admin_can_delegate_and_an_editor_cannot_change_policies(caller: Caller) -> None:
    topic = caller.create_topic()
    editor = token_of("roles/pubsub.editor")
    with pytest.raises(grpc.RpcError) as refused:
        caller.set_policy(topic, {"roles/pubsub.admin": ["user:editor@example.com"]}, token=editor)
    _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    # Once the admin makes the editor an admin of that topic, the editor may set its policy.
    caller.set_policy(topic, {"roles/pubsub.admin": ["user:editor@example.com"]})
    caller.set_policy(topic, {"roles/pubsub.publisher": ["user:nobody@example.com"]}, token=editor)
    assert len(caller.publish(topic, token="t-nobody")) == 1


def test_detach_is_checked_on_the_subscriptions_topic(caller: Caller) -> None:
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    request = types.DetachSubscriptionRequest.pb()(subscription=subscription)
    assert caller.code_of("DetachSubscription", request, "t-nobody") == grpc.StatusCode.PERMISSION_DENIED
    # An editor of the topic (not of the subscription) may detach it.
    caller.set_policy(topic, {"roles/pubsub.editor": ["user:nobody@example.com"]})
    assert caller.code_of("DetachSubscription", request, "t-nobody") == grpc.StatusCode.OK
    got = caller.call("GetSubscription", types.GetSubscriptionRequest.pb()(subscription=subscription), ADMIN)
    assert got.detached


def _with_schema(topic: str, schema: str) -> Any:
    return types.Topic.pb()(
        name=topic,
        schema_settings=types.SchemaSettings.pb()(schema=schema, encoding=schema_types.Encoding.JSON),
    )


def test_a_topic_naming_a_schema_needs_schemas_attach(caller: Caller) -> None:
    schema = caller.create_schema().name
    editor = token_of("roles/pubsub.editor")
    # The Pub/Sub editor holds pubsub.schemas.attach (with topics.create and topics.update).
    created = caller.call(
        "CreateTopic", _with_schema(f"{PROJECT}/topics/{caller.unique('t')}", schema), editor
    )
    assert created.schema_settings.schema == schema

    # An editor of one topic only (a topic policy) may update it, but not attach a schema to it: the
    # schema grants nothing to that caller.
    topic = caller.create_topic()
    caller.set_policy(topic, {"roles/pubsub.editor": ["user:nobody@example.com"]})
    attach = types.UpdateTopicRequest.pb()(
        topic=_with_schema(topic, schema), update_mask={"paths": ["schema_settings"]}
    )
    with pytest.raises(grpc.RpcError) as refused:
        caller.call("UpdateTopic", attach, "t-nobody")
    _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    get = types.GetTopicRequest.pb()(topic=topic)
    assert not caller.call("GetTopic", get, ADMIN).HasField("schema_settings")
    # A mask that leaves schema_settings alone attaches nothing, whatever the request's topic carries.
    relabel = types.UpdateTopicRequest.pb()(
        topic=_with_schema(topic, schema), update_mask={"paths": ["labels"]}
    )
    relabel.topic.labels["team"] = "a"
    assert caller.call("UpdateTopic", relabel, "t-nobody").labels == {"team": "a"}
    # Detaching (an empty schema_settings) names no schema, so needs no attach permission.
    detach = types.UpdateTopicRequest.pb()(
        topic=types.Topic.pb()(name=topic), update_mask={"paths": ["schema_settings"]}
    )
    assert caller.code_of("UpdateTopic", detach, "t-nobody") == grpc.StatusCode.OK
    # Who holds attach (the project editor) may attach it to that topic.
    assert caller.call("UpdateTopic", attach, editor).schema_settings.schema == schema
    assert caller.call("GetTopic", get, ADMIN).schema_settings.schema == schema


def test_a_schema_policy_grants_on_that_schema_only(caller: Caller) -> None:
    granted, other = caller.create_schema(), caller.create_schema()
    nobody = "t-nobody"
    caller.set_policy(granted.name, {"roles/pubsub.viewer": ["user:nobody@example.com"]})
    for name in (granted.name, f"{granted.name}@{granted.revision_id}"):  # a revision: its schema's policy
        got = caller.call("GetSchema", schema_types.GetSchemaRequest.pb()(name=name), nobody)
        assert got.revision_id == granted.revision_id
    for method, request in (
        ("GetSchema", schema_types.GetSchemaRequest.pb()(name=other.name)),
        ("ListSchemas", schema_types.ListSchemasRequest.pb()(parent=PROJECT)),  # checked on the project
        ("DeleteSchema", schema_types.DeleteSchemaRequest.pb()(name=granted.name)),
        ("GetIamPolicy", iam_policy_pb2.GetIamPolicyRequest(resource=granted.name)),
    ):
        assert caller.code_of(method, request, nobody) == grpc.StatusCode.PERMISSION_DENIED, method
    assert caller.test_permissions(granted.name, SCHEMA_ALL, nobody) == [
        "pubsub.schemas.get",
        "pubsub.schemas.listRevisions",
    ]
    assert caller.test_permissions(other.name, SCHEMA_ALL, nobody) == []

    # The schema's own policy may grant pubsub.schemas.attach: an editor of one topic (no schema
    # permission on the project) attaches the schema once the schema's policy makes them its editor.
    topic = caller.create_topic()
    caller.set_policy(topic, {"roles/pubsub.editor": ["user:nobody@example.com"]})
    attach = types.UpdateTopicRequest.pb()(
        topic=_with_schema(topic, granted.name), update_mask={"paths": ["schema_settings"]}
    )
    assert caller.code_of("UpdateTopic", attach, nobody) == grpc.StatusCode.PERMISSION_DENIED
    caller.set_policy(granted.name, {"roles/pubsub.editor": ["user:nobody@example.com"]})
    assert caller.call("UpdateTopic", attach, nobody).schema_settings.schema == granted.name

    # Setting a schema's policy needs pubsub.schemas.setIamPolicy: the Pub/Sub editor of the project
    # lacks it, an admin of that one schema holds it.
    editor = token_of("roles/pubsub.editor")
    viewer_binding = {"roles/pubsub.viewer": ["user:nobody@example.com"]}
    with pytest.raises(grpc.RpcError) as refused:
        caller.set_policy(other.name, viewer_binding, token=editor)
    _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
    caller.set_policy(other.name, {"roles/pubsub.admin": ["user:editor@example.com"]})
    caller.set_policy(other.name, viewer_binding, token=editor)
    assert caller.call("GetSchema", schema_types.GetSchemaRequest.pb()(name=other.name), nobody).name

    # Deleted, the schema's policy goes: one created again under its name grants nothing.
    caller.call("DeleteSchema", schema_types.DeleteSchemaRequest.pb()(name=other.name), ADMIN)
    schema_id = other.name.rsplit("/", 1)[1]
    avro = schema_types.Schema.pb()(type_=schema_types.Schema.Type.AVRO, definition=AVRO)
    create = schema_types.CreateSchemaRequest.pb()(parent=PROJECT, schema=avro, schema_id=schema_id)
    caller.call("CreateSchema", create, ADMIN)
    again = schema_types.GetSchemaRequest.pb()(name=other.name)
    assert caller.code_of("GetSchema", again, nobody) == grpc.StatusCode.PERMISSION_DENIED


def test_a_snapshot_policy_grants_on_that_snapshot_only(caller: Caller) -> None:
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    snapshot = f"{PROJECT}/snapshots/{caller.unique('snapshot')}"
    request = types.CreateSnapshotRequest.pb()(name=snapshot, subscription=subscription)
    caller.call("CreateSnapshot", request, ADMIN)
    other = _create_snapshot(caller)
    nobody = "t-nobody"
    caller.set_policy(snapshot, {"roles/pubsub.viewer": ["user:nobody@example.com"]})
    assert (
        caller.call("GetSnapshot", types.GetSnapshotRequest.pb()(snapshot=snapshot), nobody).name == snapshot
    )
    get_other = types.GetSnapshotRequest.pb()(snapshot=other)
    assert caller.code_of("GetSnapshot", get_other, nobody) == grpc.StatusCode.PERMISSION_DENIED
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, nobody) == ["pubsub.snapshots.get"]

    # Seeking to a snapshot needs pubsub.snapshots.seek on it besides consume on the subscription.
    caller.set_policy(subscription, {"roles/pubsub.subscriber": ["user:nobody@example.com"]})
    seek = types.SeekRequest.pb()(subscription=subscription, snapshot=snapshot)
    assert caller.code_of("Seek", seek, nobody) == grpc.StatusCode.PERMISSION_DENIED
    caller.set_policy(
        snapshot,
        {
            "roles/pubsub.viewer": ["user:nobody@example.com"],
            "roles/pubsub.subscriber": ["user:nobody@example.com"],
        },
    )
    assert caller.code_of("Seek", seek, nobody) == grpc.StatusCode.OK
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, nobody) == [
        "pubsub.snapshots.get",
        "pubsub.snapshots.seek",
    ]
    # A Seek to a time names no snapshot: consume on the subscription is enough.
    to_time = types.SeekRequest.pb()(subscription=subscription, time={"seconds": 1})
    assert caller.code_of("Seek", to_time, nobody) == grpc.StatusCode.OK

    # Reading and setting a snapshot's policy need pubsub.snapshots.getIamPolicy / setIamPolicy there.
    get_policy = iam_policy_pb2.GetIamPolicyRequest(resource=snapshot)
    assert caller.code_of("GetIamPolicy", get_policy, nobody) == grpc.StatusCode.PERMISSION_DENIED
    assert caller.code_of("GetIamPolicy", get_policy, token_of("roles/viewer")) == grpc.StatusCode.OK
    with pytest.raises(grpc.RpcError) as refused:
        caller.set_policy(snapshot, {}, token=token_of("roles/editor"))
    _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)

    # Deleted, the snapshot's policy goes with it.
    caller.call("DeleteSnapshot", types.DeleteSnapshotRequest.pb()(snapshot=snapshot), ADMIN)
    caller.call("CreateSnapshot", request, ADMIN)
    get = types.GetSnapshotRequest.pb()(snapshot=snapshot)
    assert caller.code_of("GetSnapshot", get, nobody) == grpc.StatusCode.PERMISSION_DENIED


class _SchemaGuard:
    """An authorizer that asks IAM, and also refuses ``pubsub.schemas.attach`` on one schema (as a
    schema's own policy could in Google Cloud); it records every (permission, resource) it is asked."""

    def __init__(self, enforcer: Any, guarded: str) -> None:
        self.enforcer = enforcer
        self.guarded = guarded
        self.asked: list[tuple[str, str]] = []

    def authenticate(self, metadata: Any) -> None:
        self.enforcer.authenticate(metadata)

    async def check(self, metadata: Any, permission: str, resource: str) -> None:
        self.asked.append((permission, resource))
        if permission == "pubsub.schemas.attach" and resource == self.guarded:
            raise ServiceError(StatusCode.PERMISSION_DENIED, DENIED)
        await self.enforcer.check(metadata, permission, resource)

    async def granted(self, metadata: Any, resource: str, permissions: Sequence[str]) -> list[str]:
        return await self.enforcer.granted(metadata, resource, permissions)


def test_create_topic_asks_for_schemas_attach_on_the_schema_it_names() -> None:
    guarded = f"{PROJECT}/schemas/guarded"
    guard = _SchemaGuard(IamEnforcer(iam_config()), guarded)
    with LocalServer(in_memory=True, authorizer=guard) as server:
        local = Caller(server.address)
        try:
            avro = schema_types.Schema.pb()(type_=schema_types.Schema.Type.AVRO, definition=AVRO)
            for schema_id in ("guarded", "open"):
                request = schema_types.CreateSchemaRequest.pb()(
                    parent=PROJECT, schema=avro, schema_id=schema_id
                )
                local.call("CreateSchema", request, ADMIN)
            guard.asked.clear()
            with pytest.raises(grpc.RpcError) as refused:
                local.call("CreateTopic", _with_schema(f"{PROJECT}/topics/refused", guarded), ADMIN)
            _expect(refused.value, grpc.StatusCode.PERMISSION_DENIED, DENIED)
            assert guard.asked == [
                ("pubsub.topics.create", f"{PROJECT}/topics/refused"),
                ("pubsub.schemas.attach", guarded),
            ]
            missing = types.GetTopicRequest.pb()(topic=f"{PROJECT}/topics/refused")
            assert local.code_of("GetTopic", missing, ADMIN) == grpc.StatusCode.NOT_FOUND
            allowed = local.call(
                "CreateTopic", _with_schema(f"{PROJECT}/topics/allowed", f"{PROJECT}/schemas/open"), ADMIN
            )
            assert allowed.schema_settings.schema == f"{PROJECT}/schemas/open"
            # A topic without a schema asks for nothing on schemas.
            guard.asked.clear()
            local.call("CreateTopic", types.Topic.pb()(name=f"{PROJECT}/topics/plain"), ADMIN)
            assert guard.asked == [("pubsub.topics.create", f"{PROJECT}/topics/plain")]
        finally:
            local.close()


def test_test_iam_permissions_returns_the_held_subset(caller: Caller) -> None:
    topic = caller.create_topic()
    subscription = caller.create_subscription(topic)
    publisher = token_of("roles/pubsub.publisher")
    assert caller.test_permissions(topic, TOPIC_ALL, publisher) == ["pubsub.topics.publish"]
    assert caller.test_permissions(topic, TOPIC_ALL, ADMIN) == TOPIC_ALL
    assert caller.test_permissions(topic, TOPIC_ALL, "t-nobody") == []
    assert caller.test_permissions(topic, TOPIC_ALL, token_of("roles/pubsub.viewer")) == ["pubsub.topics.get"]
    assert caller.test_permissions(topic, TOPIC_ALL, token_of("roles/pubsub.subscriber")) == [
        "pubsub.topics.attachSubscription"
    ]
    assert caller.test_permissions(subscription, SUBSCRIPTION_ALL, token_of("roles/pubsub.subscriber")) == [
        "pubsub.subscriptions.consume"
    ]
    assert caller.test_permissions(subscription, SUBSCRIPTION_ALL, token_of("roles/pubsub.editor")) == [
        "pubsub.subscriptions.consume",
        "pubsub.subscriptions.delete",
        "pubsub.subscriptions.get",
        "pubsub.subscriptions.update",
    ]
    # The order asked for is kept, and a resource grant shows up.
    caller.set_policy(topic, {"roles/pubsub.publisher": ["user:nobody@example.com"]})
    asked = ["pubsub.topics.publish", "pubsub.topics.get"]
    assert caller.test_permissions(topic, asked, "t-nobody") == ["pubsub.topics.publish"]
    with pytest.raises(grpc.RpcError) as anonymous:
        caller.test_permissions(topic, asked, None)
    _expect(anonymous.value, grpc.StatusCode.UNAUTHENTICATED, MISSING_START)


#: Every permission the access-control documentation lists for schemas and snapshots, except those checked
#: on the project (create, list, and validate for schemas), which no resource of the type can be asked about.
SCHEMA_ALL = [
    "pubsub.schemas.attach",
    "pubsub.schemas.commit",
    "pubsub.schemas.delete",
    "pubsub.schemas.get",
    "pubsub.schemas.getIamPolicy",
    "pubsub.schemas.listRevisions",
    "pubsub.schemas.rollback",
    "pubsub.schemas.setIamPolicy",
]
SNAPSHOT_ALL = [
    "pubsub.snapshots.delete",
    "pubsub.snapshots.get",
    "pubsub.snapshots.getIamPolicy",
    "pubsub.snapshots.seek",
    "pubsub.snapshots.setIamPolicy",
    "pubsub.snapshots.update",
]


def _create_snapshot(caller: Caller) -> str:
    subscription = caller.create_subscription(caller.create_topic())
    snapshot = f"{PROJECT}/snapshots/{caller.unique('snapshot')}"
    caller.call(
        "CreateSnapshot", types.CreateSnapshotRequest.pb()(name=snapshot, subscription=subscription), ADMIN
    )
    return snapshot


def test_test_iam_permissions_judges_schemas_and_snapshots_by_their_own_permissions(caller: Caller) -> None:
    schema = caller.create_schema().name
    snapshot = _create_snapshot(caller)
    assert caller.test_permissions(schema, SCHEMA_ALL, ADMIN) == SCHEMA_ALL
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, ADMIN) == SNAPSHOT_ALL
    viewer, editor = token_of("roles/pubsub.viewer"), token_of("roles/pubsub.editor")
    assert caller.test_permissions(schema, SCHEMA_ALL, viewer) == [
        "pubsub.schemas.get",
        "pubsub.schemas.listRevisions",
    ]
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, viewer) == ["pubsub.snapshots.get"]
    # The Pub/Sub editor manages schemas and snapshots but not their policies; the basic viewer reads those.
    assert caller.test_permissions(schema, SCHEMA_ALL, editor) == [
        p for p in SCHEMA_ALL if not p.endswith("IamPolicy")
    ]
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, token_of("roles/viewer")) == [
        "pubsub.snapshots.get",
        "pubsub.snapshots.getIamPolicy",
    ]
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, token_of("roles/pubsub.subscriber")) == [
        "pubsub.snapshots.seek"
    ]
    assert caller.test_permissions(schema, SCHEMA_ALL, token_of("roles/pubsub.publisher")) == []
    assert caller.test_permissions(snapshot, SNAPSHOT_ALL, "t-nobody") == []


@pytest.mark.parametrize(
    ("kind", "permission"),
    [
        # Another type's permissions, which were accepted on schemas and snapshots when both were judged
        # as topics.
        ("schema", "pubsub.topics.get"),
        ("snapshot", "pubsub.topics.publish"),
        ("schema", "pubsub.snapshots.get"),
        ("snapshot", "pubsub.schemas.get"),
        ("snapshot", "pubsub.subscriptions.consume"),
        # Project permissions.
        ("schema", "pubsub.schemas.create"),
        ("schema", "pubsub.schemas.validate"),
        ("snapshot", "pubsub.snapshots.list"),
    ],
)
def test_test_iam_permissions_refuses_permissions_of_another_type(
    caller: Caller, kind: str, permission: str
) -> None:
    resource = caller.create_schema().name if kind == "schema" else _create_snapshot(caller)
    with pytest.raises(grpc.RpcError) as refused:
        caller.test_permissions(resource, [f"pubsub.{kind}s.get", permission], ADMIN)
    _expect(
        refused.value,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Permission {permission} is not valid for resource {resource}.",
    )


def test_test_iam_permissions_on_missing_schemas_and_snapshots(caller: Caller) -> None:
    schema = f"{PROJECT}/schemas/{caller.unique('absent')}"
    snapshot = f"{PROJECT}/snapshots/{caller.unique('absent')}"
    # A stranger learns nothing; a caller holding something there learns that it does not exist.
    assert caller.test_permissions(schema, ["pubsub.schemas.get"], "t-nobody") == []
    assert caller.test_permissions(snapshot, ["pubsub.snapshots.get"], "t-nobody") == []
    for resource, permission in ((schema, "pubsub.schemas.get"), (snapshot, "pubsub.snapshots.get")):
        with pytest.raises(grpc.RpcError) as missing:
            caller.test_permissions(resource, [permission], ADMIN)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_caller_without_access_cannot_learn_what_exists(caller: Caller) -> None:
    missing = f"{PROJECT}/topics/{caller.unique('absent')}"
    request = types.GetTopicRequest.pb()(topic=missing)
    assert caller.code_of("GetTopic", request, "t-nobody") == grpc.StatusCode.PERMISSION_DENIED
    assert caller.code_of("GetTopic", request, ADMIN) == grpc.StatusCode.NOT_FOUND
    # Bad names are still bad names, for everyone.
    bad = types.GetTopicRequest.pb()(topic="not-a-topic")
    assert caller.code_of("GetTopic", bad, "t-nobody") == grpc.StatusCode.INVALID_ARGUMENT


def test_project_policy_applies_to_every_project(caller: Caller) -> None:
    topic = caller.create_topic(project=OTHER_PROJECT)
    assert len(caller.publish(topic, token=token_of("roles/pubsub.publisher"))) == 1
    assert caller.code_of("GetTopic", types.GetTopicRequest.pb()(topic=topic), "t-nobody") == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_iam_is_off_by_default() -> None:
    with LocalServer(in_memory=True) as server:
        open_caller = Caller(server.address)
        try:
            topic = f"{PROJECT}/topics/open"
            open_caller.call("CreateTopic", types.Topic.pb()(name=topic))
            assert open_caller.test_permissions(topic, ["pubsub.topics.publish"], None) == [
                "pubsub.topics.publish"
            ]
        finally:
            open_caller.close()


def test_official_clients_test_each_type_with_its_own_permissions_when_iam_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from google.api_core import exceptions
    from google.cloud import pubsub_v1

    with LocalServer(in_memory=True) as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        schemas = pubsub_v1.SchemaServiceClient()
        try:
            topic = publisher.create_topic(name=f"{PROJECT}/topics/open").name
            subscription = subscriber.create_subscription(
                name=f"{PROJECT}/subscriptions/open", topic=topic
            ).name
            snapshot = subscriber.create_snapshot(
                name=f"{PROJECT}/snapshots/open", subscription=subscription
            ).name
            schema = schemas.create_schema(
                parent=PROJECT,
                schema=schema_types.Schema(type_=schema_types.Schema.Type.AVRO, definition=AVRO),
                schema_id="open",
            ).name
            cases = [
                (publisher, topic, TOPIC_ALL),
                (subscriber, subscription, SUBSCRIPTION_ALL),
                (subscriber, snapshot, SNAPSHOT_ALL),
                (schemas, schema, SCHEMA_ALL),
            ]
            for client, resource, permissions in cases:
                # Not enforcing: every permission valid for the type is granted.
                asked = {"resource": resource, "permissions": permissions}
                assert list(client.test_iam_permissions(request=asked).permissions) == permissions
                foreign = {"resource": resource, "permissions": ["pubsub.topics.create"]}
                with pytest.raises(exceptions.InvalidArgument, match="is not valid for resource"):
                    client.test_iam_permissions(request=foreign)
            with pytest.raises(exceptions.InvalidArgument, match=r"pubsub\.topics\.get is not valid"):
                schemas.test_iam_permissions(
                    request={"resource": schema, "permissions": ["pubsub.topics.get"]}
                )
            for missing, permission in (
                (f"{PROJECT}/snapshots/absent", "pubsub.snapshots.get"),
                (f"{PROJECT}/schemas/absent", "pubsub.schemas.get"),
            ):
                with pytest.raises(exceptions.NotFound):
                    subscriber.test_iam_permissions(
                        request={"resource": missing, "permissions": [permission]}
                    )
            # A schema revision carries no permissions of its own.
            with pytest.raises(exceptions.InvalidArgument):
                schemas.test_iam_permissions(
                    request={"resource": f"{schema}@abc", "permissions": ["pubsub.schemas.get"]}
                )
        finally:
            publisher.transport.close()
            subscriber.close()
            schemas.transport.close()


def test_hedgepub_publisher_sends_its_credentials_token(iam_server: LocalServer, caller: Caller) -> None:
    import google.oauth2.credentials

    from hedgepub import PublisherClient, RpcError

    topic = caller.create_topic()
    endpoint = f"http://{iam_server.address}"
    publisher_credentials = google.oauth2.credentials.Credentials(token_of("roles/pubsub.publisher"))
    with PublisherClient(endpoint=endpoint, credentials=publisher_credentials) as publisher:
        ids = [publisher.publish(topic, f"m{i}".encode(), origin="test") for i in range(5)]
        message_ids = [future.result(timeout=10) for future in ids]
    stored = iam_server.messages(topic)
    assert [message.message_id for message in stored] == message_ids
    assert {message.attributes["origin"] for message in stored} == {"test"}

    viewer_credentials = google.oauth2.credentials.Credentials(token_of("roles/pubsub.viewer"))
    with (
        PublisherClient(endpoint=endpoint, credentials=viewer_credentials) as publisher,
        pytest.raises(RpcError) as denied,
    ):
        publisher.publish(topic, b"no").result(timeout=10)
    assert denied.value.code.name == "PERMISSION_DENIED"
    assert DENIED in str(denied.value)

    with PublisherClient(endpoint=endpoint) as anonymous, pytest.raises(RpcError) as unauthenticated:
        anonymous.publish(topic, b"no").result(timeout=10)
    assert unauthenticated.value.code.name == "UNAUTHENTICATED"
    assert len(iam_server.messages(topic)) == 5


def test_official_client_sends_a_token_through_call_metadata(
    iam_server: LocalServer, caller: Caller, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.api_core import exceptions
    from google.cloud import pubsub_v1

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", iam_server.address)
    topic = caller.create_topic()
    client = pubsub_v1.PublisherClient()
    try:
        metadata = [("authorization", f"Bearer {token_of('roles/pubsub.viewer')}")]
        assert client.get_topic(request={"topic": topic}, metadata=metadata).name == topic
        with pytest.raises(exceptions.PermissionDenied, match=DENIED):
            client.delete_topic(request={"topic": topic}, metadata=metadata)
        with pytest.raises(exceptions.Unauthenticated):
            client.get_topic(request={"topic": topic})
    finally:
        client.transport.close()
