"""Malformed and boundary requests to every RPC, through raw gRPC, against one SQLite-backed server.

Hypothesis draws the requests: resource names (random text, IDs of 2/3/255/256 characters, the reserved
``goog`` prefix, bad characters, wrong project or collection forms), message counts (0, 1000, 1001),
attributes (100/101 of them, keys of 256/257 bytes, values of 1024/1025 bytes), ack IDs (garbage, empty,
well-formed but unknown), deadlines (-1, 0, 9, 10, 600, 601), page tokens and sizes, field masks, IAM
policies, and plain garbage bytes as the request body of every method. For every case:

- the answer is OK or a status code the service documents for that method, with a non-empty message;
  never UNKNOWN or INTERNAL (which would mean an unhandled error inside the server);
- the server keeps serving: a known-good request succeeds after each case;
- at the end the stored state is consistent (lists agree with gets, every subscription's topic exists
  or is ``_deleted-topic_``), survives a restart of the server on the same SQLite file, and a
  publish-and-pull round trip works.

The number of cases each test ran is printed at the end (``pytest -s``). Settings (environment):
``HEDGEPUB_TRUST_EXAMPLES`` multiplies every test's ``max_examples`` (default 1; the long run uses 10);
``HEDGEPUB_TRUST_DEBUG=1`` prints every answer.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.iam.v1 import iam_policy_pb2, options_pb2, policy_pb2
from google.protobuf import duration_pb2, empty_pb2, field_mask_pb2
from google.pubsub_v1.types import pubsub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hedgepub.server import LocalServer
from hedgepub.server._methods import METHODS

SCALE = int(os.environ.get("HEDGEPUB_TRUST_EXAMPLES", "") or 1)

# The known-good resources (project "trust"); the drawn names live in project "fuzz" or elsewhere.
GOOD_TOPIC = "projects/trust/topics/known-good"
GOOD_SUBSCRIPTION = "projects/trust/subscriptions/known-good"
# Drawn requests aim at these often, so that checks past "does it exist" are reached too.
FUZZ_TOPIC = "projects/fuzz/topics/stable"
FUZZ_SUBSCRIPTION = "projects/fuzz/subscriptions/stable"
DELETED_TOPIC = "_deleted-topic_"
# Push endpoints drawn: loopback only, on the discard port, where nothing answers.
_PUSH_ENDPOINT = "http://127.0.0.1:9/push"

PB: dict[str, Any] = {
    name: getattr(pubsub, name).pb()
    for name in (
        "Topic",
        "Subscription",
        "PubsubMessage",
        "PublishRequest",
        "PublishResponse",
        "GetTopicRequest",
        "UpdateTopicRequest",
        "ListTopicsRequest",
        "ListTopicsResponse",
        "ListTopicSubscriptionsRequest",
        "ListTopicSubscriptionsResponse",
        "ListTopicSnapshotsRequest",
        "DeleteTopicRequest",
        "DetachSubscriptionRequest",
        "GetSubscriptionRequest",
        "UpdateSubscriptionRequest",
        "ListSubscriptionsRequest",
        "ListSubscriptionsResponse",
        "DeleteSubscriptionRequest",
        "ModifyAckDeadlineRequest",
        "AcknowledgeRequest",
        "PullRequest",
        "PullResponse",
        "StreamingPullRequest",
        "ModifyPushConfigRequest",
        "GetSnapshotRequest",
        "ListSnapshotsRequest",
        "CreateSnapshotRequest",
        "UpdateSnapshotRequest",
        "DeleteSnapshotRequest",
        "SeekRequest",
        "PushConfig",
        "DeadLetterPolicy",
        "RetryPolicy",
        "ExpirationPolicy",
        "Snapshot",
    )
}

# METHODS (every method of the four services, short name -> full path) is the fault injector's table,
# which tests/server/test_faults.py checks against the protocol descriptors.

#: Codes any RPC may answer with (Pub/Sub's documented error codes that bad input can cause).
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
#: Further codes documented for some methods: BigQuery and Bigtable subscriptions are not served by the
#: local server (UNIMPLEMENTED, naming what is missing; Cloud Storage ones without --buckets-dir are
#: FAILED_PRECONDITION), nor AI inference transforms (UNIMPLEMENTED); snapshots, Seek and push are
#: served, so they answer only documented codes; SetIamPolicy answers ABORTED to a stale etag.
EXTRA_CODES: dict[str, frozenset[grpc.StatusCode]] = {
    **{
        method: frozenset({grpc.StatusCode.UNIMPLEMENTED})
        for method in ("CreateSubscription", "UpdateSubscription", "CreateTopic", "UpdateTopic")
    },
    "SetIamPolicy": frozenset({grpc.StatusCode.ABORTED}),
}

#: Cases run per test (printed at the end).
CASES: Counter[str] = Counter()
#: Codes seen per method (printed at the end).
CODES: Counter[tuple[str, str]] = Counter()
#: Projects in which a drawn request created something (the final consistency check lists them).
PROJECTS: set[str] = {"trust", "fuzz"}


def examples(count: int) -> Any:
    """Hypothesis settings for one test: ``count`` examples (times HEDGEPUB_TRUST_EXAMPLES)."""
    return settings(
        max_examples=count * SCALE,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# ----------------------------------------------------------------------------- the server and calls
class Client:
    """Raw calls: the request as bytes in, (status code, details, response bytes) out."""

    def __init__(self, address: str) -> None:
        options = [("grpc.max_send_message_length", 32 * 1024 * 1024)]
        self.channel = grpc.insecure_channel(address, options=options)

    def raw(self, method: str, body: bytes, timeout: float = 10.0) -> tuple[grpc.StatusCode, str, bytes]:
        """Send ``body`` as the request of ``method`` (short name or full path)."""
        path = METHODS.get(method, method)
        if method == "StreamingPull":
            return self.stream(path, [body], timeout=10.0)
        call = self.channel.unary_unary(path)
        try:
            response, rpc = call.with_call(body, timeout=timeout)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", b""
        return rpc.code(), rpc.details() or "", response

    def stream(self, path: str, bodies: list[bytes], timeout: float) -> tuple[grpc.StatusCode, str, bytes]:
        """A StreamingPull with these requests, half-closed after them; reads until the stream ends."""
        call = self.channel.stream_stream(path)
        responses = call(iter(bodies), timeout=timeout)
        last = b""
        try:
            for response in responses:
                last = response
        except grpc.RpcError as error:
            return error.code(), error.details() or "", last
        return responses.code(), responses.details() or "", last

    def call(self, method: str, request: Any, timeout: float = 10.0) -> tuple[grpc.StatusCode, str, bytes]:
        """Send a protobuf message."""
        return self.raw(method, request.SerializeToString(), timeout)

    def ok(self, method: str, request: Any, response_class: Any) -> Any:
        """A call that must succeed; returns the parsed response."""
        code, details, body = self.call(method, request)
        assert code == grpc.StatusCode.OK, f"{method} answered {code.name}: {details}"
        return response_class.FromString(body)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite directory of the module's server (kept for the restart check)."""
    return tmp_path_factory.mktemp("bad-input")


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[LocalServer]:
    """One SQLite-backed server for the whole module, with the known-good and fuzz targets created."""
    with LocalServer(data_dir=data_dir) as local:
        client = Client(local.address)
        for topic in (GOOD_TOPIC, FUZZ_TOPIC):
            client.ok("CreateTopic", PB["Topic"](name=topic), PB["Topic"])
        client.ok(
            "CreateSubscription",
            PB["Subscription"](name=GOOD_SUBSCRIPTION, topic=GOOD_TOPIC),
            PB["Subscription"],
        )
        client.ok(
            "CreateSubscription",
            PB["Subscription"](name=FUZZ_SUBSCRIPTION, topic=FUZZ_TOPIC),
            PB["Subscription"],
        )
        client.close()
        yield local


@pytest.fixture(scope="module")
def client(server: LocalServer) -> Iterator[Client]:
    """A raw gRPC client of the module's server."""
    raw = Client(server.address)
    yield raw
    raw.close()


def check_answer(client: Client, method: str, code: grpc.StatusCode, details: str) -> None:
    """The answer is documented for ``method``, explained, and the server still serves."""
    CODES[(method, code.name)] += 1
    if os.environ.get("HEDGEPUB_TRUST_DEBUG"):
        print(method, code.name, details[:150])
    allowed = DOCUMENTED | EXTRA_CODES.get(method, frozenset())
    assert code in allowed, f"{method} answered {code.name} (not a documented code): {details!r}"
    if code != grpc.StatusCode.OK:
        assert details.strip(), f"{method} answered {code.name} without a message"
        assert "Traceback" not in details and "Exception" not in details, details
    still = client.call("GetTopic", PB["GetTopicRequest"](topic=GOOD_TOPIC))
    assert still[0] == grpc.StatusCode.OK, f"the server stopped serving after a {method} case: {still[1]}"


# ----------------------------------------------------------------------------- strategies
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_ids = st.one_of(
    st.sampled_from(
        [
            "abc",
            "ab",
            "a",
            "",
            "a" * 255,
            "a" * 256,
            "b" * 3,
            "goog-thing",
            "GOOGthing",
            "google",
            "1abc",
            "-abc",
            "a b",
            "abc/def",
            "abc?x",
            "abc#",
            "ünïcode",
            "abc\x00def",
            "A-b_c.d~e+f%g",
            "fuzz-1",
            "fuzz-2",
        ]
    ),
    st.from_regex(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,12}", fullmatch=True),
    _text,
)
_projects = st.one_of(
    st.sampled_from(
        ["fuzz", "fuzz", "", "fuzz project", "p" * 128, "p" * 129, "-fuzz", "example.com:fuzz", "*"]
    ),
    _text,
)
_OTHER = {"topics": "subscriptions", "subscriptions": "topics", "snapshots": "topics"}


def mostly(good: st.SearchStrategy[Any], other: st.SearchStrategy[Any], percent: int = 60) -> Any:
    """``good`` in about ``percent``% of the draws, else ``other``.

    Drawn as an integer rather than with ``one_of``, so that the good branch keeps its share: Hypothesis
    stops repeating a branch whose draws it has already seen.
    """
    return st.integers(0, 99).flatmap(lambda roll: good if roll < percent else other)


#: Valid IDs from a small pool, so drawn requests meet existing resources (ALREADY_EXISTS, deletes...).
_pool_ids = st.sampled_from(["fuzz-1", "fuzz-2", "fuzz-3", "abc", "a" * 255, "A-b_c.d~e+f%g"])


def names(collection: str, favourite: str | None = None) -> st.SearchStrategy[str]:
    """Resource names of ``collection``: mostly valid (often existing), else boundary or malformed."""
    valid = [st.builds(lambda rid: f"projects/fuzz/{collection}/{rid}", _pool_ids)]
    if favourite is not None:
        valid.append(st.just(favourite))
    malformed = st.one_of(
        st.builds(lambda project, rid: f"projects/{project}/{collection}/{rid}", _projects, _ids),
        st.builds(lambda rid: f"projects/fuzz/{collection}/{rid}", _ids),
        st.builds(lambda rid: f"projects/fuzz/{_OTHER[collection]}/{rid}", _ids),
        st.builds(lambda project, rid: f"{project}/{rid}", _projects, _ids),
        st.sampled_from(
            [
                "",
                "projects/fuzz",
                f"projects/fuzz/{collection}",
                f"projects/fuzz/{collection}/",
                f"projects/fuzz/{collection}/abc/extra",
                f"projects//{collection}/abc",
                f"//{collection}//",
                f"Projects/fuzz/{collection}/abc",
                DELETED_TOPIC,
            ]
        ),
        _text,
    )
    return mostly(st.one_of(*valid), malformed)


_topics = names("topics", FUZZ_TOPIC)
_subscriptions = names("subscriptions", FUZZ_SUBSCRIPTION)
_project_names = mostly(
    st.sampled_from(["projects/fuzz", "projects/trust"]),
    st.one_of(st.builds(lambda project: f"projects/{project}", _projects), _text),
)
_int32 = st.one_of(
    st.sampled_from([-1, 0, 1, 9, 10, 600, 601, 1000, 1001, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
_deadlines = mostly(st.integers(10, 600), st.one_of(st.sampled_from([-1, 0, 9, 10, 600, 601]), _int32))
_page_tokens = st.one_of(
    st.sampled_from(
        [
            "",
            "garbage",
            "!!!",
            base64.urlsafe_b64encode(b"after:").decode(),
            base64.urlsafe_b64encode(b"after:projects/fuzz/topics/stable").decode(),
            base64.urlsafe_b64encode(b"\xff\xfe").decode(),
            base64.urlsafe_b64encode(b"before:x").decode(),
            "YWZ0ZXI6",
            "====",
        ]
    ),
    _text,
)
_ack_ids = st.lists(
    mostly(
        st.from_regex(r"[0-9a-f]{8}-[0-9]{1,6}", fullmatch=True),
        st.one_of(
            st.sampled_from(
                ["", "-", "deadbeef-1", "deadbeef-x", "deadbeef-", "0" * 8 + "-" + "9" * 40, "x-1"]
            ),
            _text,
        ),
    ),
    max_size=6,
)
_durations = st.builds(
    lambda seconds, nanos: duration_pb2.Duration(seconds=seconds, nanos=nanos),
    st.sampled_from([-1, 0, 1, 599, 600, 601, 7 * 86400, 7 * 86400 + 1, 31 * 86400, 31 * 86400 + 1, 2**40]),
    st.sampled_from([0, 0, 1, -1, 999_999_999, 10**9]),
)
_labels = st.dictionaries(_text, _text, max_size=3)


@st.composite
def _attributes(draw: st.DrawFn) -> dict[str, str]:
    kind = draw(mostly(st.just("random"), st.sampled_from(["count", "key", "value", "goog", "empty-key"])))
    if kind == "count":
        count = draw(st.sampled_from([100, 101]))
        return {f"k{index}": "v" for index in range(count)}
    if kind == "key":
        return {"k" * draw(st.sampled_from([256, 257])): "v"}
    if kind == "value":
        return {"k": "v" * draw(st.sampled_from([1024, 1025]))}
    if kind == "goog":
        return {"googKey": "v"}
    if kind == "empty-key":
        return {"": "v"}
    return draw(
        st.dictionaries(
            mostly(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), _text), _text, max_size=4
        )
    )


_messages = st.builds(
    lambda data, attributes, ordering_key, message_id: PB["PubsubMessage"](
        data=data, attributes=attributes, ordering_key=ordering_key, message_id=message_id
    ),
    mostly(st.binary(min_size=1, max_size=64), st.just(b""), 85),
    mostly(st.just({}), _attributes(), 50),
    mostly(st.just(""), st.one_of(st.sampled_from(["k" * 1024, "k" * 1025]), _text), 70),
    st.one_of(st.just(""), _text),
)


@st.composite
def _publish_requests(draw: st.DrawFn) -> Any:
    topic = draw(mostly(st.just(FUZZ_TOPIC), _topics, 75))
    count = draw(mostly(st.integers(1, 3), st.sampled_from([0, 1000, 1001]), 85))
    if count >= 1000:
        # Many messages: one drawn message and a filler, so the count (not the content) is the subject.
        messages = [draw(_messages)] + [PB["PubsubMessage"](data=b"x")] * (count - 1)
    else:
        messages = [draw(_messages) for _ in range(count)]
    return PB["PublishRequest"](topic=topic, messages=messages)


_any_masks = st.builds(
    lambda paths: field_mask_pb2.FieldMask(paths=paths),
    st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "labels",
                    "message_retention_duration",
                    "message_retention_duration.seconds",
                    "name",
                    "topic",
                    "kms_key_name",
                    "schema_settings",
                    "message_storage_policy",
                    "ack_deadline_seconds",
                    "ackDeadlineSeconds",
                    "push_config",
                    "push_config.push_endpoint",
                    "dead_letter_policy",
                    "dead_letter_policy.max_delivery_attempts",
                    "retry_policy",
                    "expiration_policy",
                    "enable_exactly_once_delivery",
                    "labels.key",
                    "unknown_field",
                    "",
                    ".",
                    "labels..x",
                    "*",
                ]
            ),
            _text,
        ),
        max_size=3,
    ),
)
_masks = mostly(
    st.builds(
        lambda paths: field_mask_pb2.FieldMask(paths=paths),
        st.lists(
            st.sampled_from(["labels", "message_retention_duration", "ack_deadline_seconds", "retry_policy"]),
            min_size=1,
            max_size=2,
            unique=True,
        ),
    ),
    _any_masks,
)


@st.composite
def _topic_bodies(draw: st.DrawFn, name: st.SearchStrategy[str]) -> Any:
    topic = PB["Topic"](
        name=draw(name), labels=draw(_labels), kms_key_name=draw(st.one_of(st.just(""), _text))
    )
    if draw(st.booleans()):
        topic.message_retention_duration.CopyFrom(draw(_durations))
    if draw(st.booleans()):
        topic.message_storage_policy.allowed_persistence_regions.extend(draw(st.lists(_text, max_size=2)))
    return topic


@st.composite
def _subscription_bodies(draw: st.DrawFn, name: st.SearchStrategy[str]) -> Any:
    subscription = PB["Subscription"](
        name=draw(name),
        topic=draw(st.one_of(st.just(FUZZ_TOPIC), _topics)),
        ack_deadline_seconds=draw(_deadlines),
        labels=draw(_labels),
        enable_message_ordering=draw(st.booleans()),
        retain_acked_messages=draw(st.booleans()),
        detached=draw(mostly(st.just(False), st.just(True), 80)),
    )
    if draw(st.booleans()):
        subscription.message_retention_duration.CopyFrom(draw(_durations))
    extra = draw(
        mostly(
            st.just("none"),
            st.sampled_from(["push", "filter", "exactly-once", "dead-letter", "retry", "expiry"]),
            40,
        )
    )
    if extra == "push":
        subscription.push_config.push_endpoint = draw(st.sampled_from(["", _PUSH_ENDPOINT]))
    elif extra == "filter":
        subscription.filter = draw(st.sampled_from(['attributes.k = "v"', "((("]))
    elif extra == "exactly-once":
        subscription.enable_exactly_once_delivery = True
    elif extra == "dead-letter":
        subscription.dead_letter_policy.dead_letter_topic = draw(st.one_of(st.just(FUZZ_TOPIC), _topics))
        subscription.dead_letter_policy.max_delivery_attempts = draw(
            st.one_of(st.sampled_from([0, 4, 5, 100, 101, -1]), _int32)
        )
    elif extra == "retry":
        subscription.retry_policy.minimum_backoff.CopyFrom(draw(_durations))
        subscription.retry_policy.maximum_backoff.CopyFrom(draw(_durations))
    elif extra == "expiry":
        subscription.expiration_policy.ttl.CopyFrom(draw(_durations))
    return subscription


_policies = st.builds(
    lambda version, bindings, etag: policy_pb2.Policy(version=version, bindings=bindings, etag=etag),
    st.sampled_from([-1, 0, 1, 3, 4]),
    st.lists(
        st.builds(
            lambda role, members: policy_pb2.Binding(role=role, members=members),
            st.one_of(st.sampled_from(["roles/pubsub.publisher", "roles/viewer", "", "roles/nope"]), _text),
            st.lists(
                st.one_of(st.sampled_from(["user:a@example.com", "allUsers", "", "nobody"]), _text),
                max_size=3,
            ),
        ),
        max_size=3,
    ),
    st.one_of(st.just(b""), st.binary(max_size=12)),
)
_iam_resources = st.one_of(
    st.just(FUZZ_TOPIC),
    st.just(FUZZ_SUBSCRIPTION),
    _topics,
    _subscriptions,
    names("snapshots"),
    _project_names,
)
_permissions = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "pubsub.topics.publish",
                "pubsub.subscriptions.consume",
                "pubsub.topics.get",
                "pubsub.subscriptions.get",
                "pubsub.topics.create",
                "",
                "*",
                "pubsub.topics.*",
            ]
        ),
        _text,
    ),
    max_size=5,
)


# ----------------------------------------------------------------------------- the tests
@examples(120)
@given(request=_publish_requests())
def test_publish(client: Client, server: LocalServer, request: Any) -> None:
    CASES["Publish"] += 1
    code, details, body = client.call("Publish", request)
    check_answer(client, "Publish", code, details)
    if code == grpc.StatusCode.OK:
        ids = list(PB["PublishResponse"].FromString(body).message_ids)
        assert len(ids) == len(request.messages)
        stored = {message.message_id: message for message in server.messages(request.topic)}
        for message_id, sent in zip(ids, request.messages, strict=True):
            assert stored[message_id].data == sent.data
            assert stored[message_id].attributes == dict(sent.attributes)


@examples(150)
@given(
    case=st.one_of(
        st.tuples(st.just("CreateTopic"), _topic_bodies(names("topics"))),
        st.tuples(st.just("GetTopic"), st.builds(lambda t: PB["GetTopicRequest"](topic=t), _topics)),
        st.tuples(
            st.just("UpdateTopic"),
            st.builds(
                lambda topic, mask: PB["UpdateTopicRequest"](topic=topic, update_mask=mask),
                _topic_bodies(_topics),
                _masks,
            ),
        ),
        st.tuples(
            st.just("ListTopics"),
            st.builds(
                lambda project, size, token: PB["ListTopicsRequest"](
                    project=project, page_size=size, page_token=token
                ),
                _project_names,
                _int32,
                _page_tokens,
            ),
        ),
        st.tuples(
            st.just("ListTopicSubscriptions"),
            st.builds(
                lambda topic, size, token: PB["ListTopicSubscriptionsRequest"](
                    topic=topic, page_size=size, page_token=token
                ),
                _topics,
                _int32,
                _page_tokens,
            ),
        ),
        st.tuples(
            st.just("ListTopicSnapshots"),
            st.builds(lambda t: PB["ListTopicSnapshotsRequest"](topic=t), _topics),
        ),
        # Names drawn without the stable favourite, so the fuzz topic outlives deletions.
        st.tuples(
            st.just("DeleteTopic"), st.builds(lambda t: PB["DeleteTopicRequest"](topic=t), names("topics"))
        ),
        st.tuples(
            st.just("DetachSubscription"),
            st.builds(lambda s: PB["DetachSubscriptionRequest"](subscription=s), names("subscriptions")),
        ),
    )
)
def test_publisher_admin(client: Client, case: tuple[str, Any]) -> None:
    method, request = case
    CASES[method] += 1
    code, details, _ = client.call(method, request)
    check_answer(client, method, code, details)
    if method == "CreateTopic" and code == grpc.StatusCode.OK:
        PROJECTS.add(request.name.split("/")[1])


@examples(150)
@given(
    case=st.one_of(
        st.tuples(st.just("CreateSubscription"), _subscription_bodies(names("subscriptions"))),
        st.tuples(
            st.just("GetSubscription"),
            st.builds(lambda s: PB["GetSubscriptionRequest"](subscription=s), _subscriptions),
        ),
        st.tuples(
            st.just("UpdateSubscription"),
            st.builds(
                lambda subscription, mask: PB["UpdateSubscriptionRequest"](
                    subscription=subscription, update_mask=mask
                ),
                _subscription_bodies(_subscriptions),
                _masks,
            ),
        ),
        st.tuples(
            st.just("ListSubscriptions"),
            st.builds(
                lambda project, size, token: PB["ListSubscriptionsRequest"](
                    project=project, page_size=size, page_token=token
                ),
                _project_names,
                _int32,
                _page_tokens,
            ),
        ),
        st.tuples(
            st.just("DeleteSubscription"),
            st.builds(lambda s: PB["DeleteSubscriptionRequest"](subscription=s), names("subscriptions")),
        ),
        st.tuples(
            st.just("ModifyPushConfig"),
            st.builds(
                lambda s, endpoint: PB["ModifyPushConfigRequest"](
                    subscription=s, push_config=PB["PushConfig"](push_endpoint=endpoint)
                ),
                _subscriptions,
                st.one_of(
                    st.sampled_from(["", _PUSH_ENDPOINT, "ftp://127.0.0.1/x", "http://", "/push"]), _text
                ),
            ),
        ),
        st.tuples(
            st.just("GetSnapshot"),
            st.builds(lambda s: PB["GetSnapshotRequest"](snapshot=s), names("snapshots")),
        ),
        st.tuples(
            st.just("ListSnapshots"),
            st.builds(
                lambda p, token: PB["ListSnapshotsRequest"](project=p, page_token=token),
                _project_names,
                _page_tokens,
            ),
        ),
        st.tuples(
            st.just("CreateSnapshot"),
            st.builds(
                lambda n, s: PB["CreateSnapshotRequest"](name=n, subscription=s),
                names("snapshots"),
                _subscriptions,
            ),
        ),
        st.tuples(
            st.just("UpdateSnapshot"),
            st.builds(
                lambda n, mask: PB["UpdateSnapshotRequest"](
                    snapshot=PB["Snapshot"](name=n), update_mask=mask
                ),
                names("snapshots"),
                _masks,
            ),
        ),
        st.tuples(
            st.just("DeleteSnapshot"),
            st.builds(lambda s: PB["DeleteSnapshotRequest"](snapshot=s), names("snapshots")),
        ),
        st.tuples(
            st.just("Seek"),
            st.builds(
                lambda s, n: PB["SeekRequest"](subscription=s, snapshot=n), _subscriptions, names("snapshots")
            ),
        ),
    )
)
def test_subscriber_admin(client: Client, case: tuple[str, Any]) -> None:
    method, request = case
    CASES[method] += 1
    code, details, _ = client.call(method, request)
    check_answer(client, method, code, details)
    if method == "CreateSubscription" and code == grpc.StatusCode.OK:
        PROJECTS.add(request.name.split("/")[1])


@examples(150)
@given(
    case=st.one_of(
        st.tuples(
            st.just("Pull"),
            st.builds(
                lambda s, n, immediately: PB["PullRequest"](
                    subscription=s, max_messages=n, return_immediately=immediately
                ),
                _subscriptions,
                mostly(st.integers(1, 1000), st.one_of(st.sampled_from([-1, 0, 1001]), _int32)),
                # Mostly immediate: a waiting Pull on an empty subscription costs its whole timeout.
                st.sampled_from([True, True, True, False]),
            ),
        ),
        st.tuples(
            st.just("Acknowledge"),
            st.builds(
                lambda s, ids: PB["AcknowledgeRequest"](subscription=s, ack_ids=ids), _subscriptions, _ack_ids
            ),
        ),
        st.tuples(
            st.just("ModifyAckDeadline"),
            st.builds(
                lambda s, ids, seconds: PB["ModifyAckDeadlineRequest"](
                    subscription=s, ack_ids=ids, ack_deadline_seconds=seconds
                ),
                _subscriptions,
                _ack_ids,
                st.one_of(st.sampled_from([0, -1, 600, 601]), _deadlines),
            ),
        ),
    ),
    real_leases=mostly(st.integers(1, 5), st.just(0)),
)
def test_delivery(client: Client, case: tuple[str, Any], real_leases: int) -> None:
    method, request = case
    CASES[method] += 1
    if real_leases and method != "Pull" and request.subscription == FUZZ_SUBSCRIPTION:
        # Mix in ack IDs of live leases, so acks and deadline changes act on real messages too.
        code, _, body = client.call(
            "Pull",
            PB["PullRequest"](
                subscription=FUZZ_SUBSCRIPTION, max_messages=real_leases, return_immediately=True
            ),
        )
        if code == grpc.StatusCode.OK:
            leased = PB["PullResponse"].FromString(body).received_messages
            request.ack_ids.extend(received.ack_id for received in leased)
    timeout = 0.5 if method == "Pull" and not request.return_immediately else 10.0
    code, details, _ = client.call(method, request, timeout=timeout)
    check_answer(client, method, code, details)


@st.composite
def _streaming_requests(draw: st.DrawFn) -> list[Any]:
    first = PB["StreamingPullRequest"](
        subscription=draw(mostly(st.just(FUZZ_SUBSCRIPTION), st.one_of(_subscriptions, st.just("")))),
        stream_ack_deadline_seconds=draw(_deadlines),
        ack_ids=draw(_ack_ids),
        max_outstanding_messages=draw(
            mostly(st.integers(0, 1000), st.one_of(st.just(-1), st.integers(-(2**63), 2**63 - 1)))
        ),
        max_outstanding_bytes=draw(
            mostly(st.integers(0, 10**7), st.one_of(st.just(-1), st.integers(-(2**63), 2**63 - 1)))
        ),
        client_id=draw(_text),
    )
    ack_ids = draw(_ack_ids)
    first.modify_deadline_ack_ids.extend(ack_ids)
    # Usually as many deadlines as ack IDs; sometimes not, which the service refuses.
    seconds = draw(
        mostly(
            st.lists(_deadlines, min_size=len(ack_ids), max_size=len(ack_ids)),
            st.lists(_deadlines, max_size=3),
            80,
        )
    )
    first.modify_deadline_seconds.extend(seconds)
    later = draw(
        st.lists(
            st.builds(
                lambda ids, deadline: PB["StreamingPullRequest"](
                    ack_ids=ids, stream_ack_deadline_seconds=deadline
                ),
                _ack_ids,
                _deadlines,
            ),
            max_size=2,
        )
    )
    return [first, *later]


@examples(60)
@given(requests=_streaming_requests())
def test_streaming_pull(client: Client, requests: list[Any]) -> None:
    CASES["StreamingPull"] += 1
    code, details, _ = client.stream(
        METHODS["StreamingPull"], [request.SerializeToString() for request in requests], timeout=10.0
    )
    check_answer(client, "StreamingPull", code, details)


@examples(120)
@given(
    case=st.one_of(
        st.tuples(
            st.just("SetIamPolicy"),
            st.builds(
                lambda resource, policy, mask: iam_policy_pb2.SetIamPolicyRequest(
                    resource=resource, policy=policy, update_mask=mask
                ),
                _iam_resources,
                _policies,
                _masks,
            ),
        ),
        st.tuples(
            st.just("GetIamPolicy"),
            st.builds(
                lambda resource, version: iam_policy_pb2.GetIamPolicyRequest(
                    resource=resource, options=options_pb2.GetPolicyOptions(requested_policy_version=version)
                ),
                _iam_resources,
                st.sampled_from([-1, 0, 1, 3, 4]),
            ),
        ),
        st.tuples(
            st.just("TestIamPermissions"),
            st.builds(
                lambda resource, permissions: iam_policy_pb2.TestIamPermissionsRequest(
                    resource=resource, permissions=permissions
                ),
                _iam_resources,
                _permissions,
            ),
        ),
    )
)
def test_iam(client: Client, case: tuple[str, Any]) -> None:
    method, request = case
    CASES[method] += 1
    code, details, _ = client.call(method, request)
    check_answer(client, method, code, details)


# Bytes that are not a valid protobuf message (truncated varints and lengths, invalid UTF-8 in a
# string field, a wrong wire type, an end-group tag), then random bytes.
_GARBAGE = st.one_of(
    st.sampled_from(
        [
            b"\x0a",
            b"\x0a\x05abc",
            b"\x0a\x02\xff\xfe",
            b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
            b"\x0c",
            b"\x0a\xff\xff\xff\xff\x0f",
            b"\xff" * 16,
            b"\x12\x03\x0a\x01\xff",
        ]
    ),
    st.binary(max_size=200),
)


@examples(200)
@given(method=st.sampled_from(sorted(METHODS)), body=_GARBAGE)
def test_garbage_bodies(client: Client, method: str, body: bytes) -> None:
    CASES["garbage bytes"] += 1
    code, details, _ = client.raw(method, body)
    check_answer(client, method, code, details)


# ----------------------------------------------------------------------------- REST bodies and filters
#: Statuses a REST call may answer with (the HTTP forms of the documented codes; 413 for a body over the
#: size limit). Never 500: that would be an unhandled error.
REST_DOCUMENTED = frozenset({200, 400, 401, 403, 404, 409, 413, 429})
_REST_ROUTES = [
    ("PUT", "/v1/projects/fuzz/topics/rest-fuzz"),
    ("PATCH", f"/v1/{FUZZ_TOPIC}"),
    ("POST", f"/v1/{FUZZ_TOPIC}:publish"),
    ("PUT", "/v1/projects/fuzz/subscriptions/rest-fuzz"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:pull"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:acknowledge"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:modifyAckDeadline"),
    ("POST", "/v1/projects/fuzz/schemas:validateMessage"),
    ("POST", f"/v1/{FUZZ_TOPIC}:setIamPolicy"),
    ("POST", "/v1/projects/fuzz:testMessageTransforms"),
    ("POST", "/v1/projects/fuzz:validateMessageTransform"),
]
_FIELD_NAMES = st.sampled_from(
    ["messages", "data", "attributes", "orderingKey", "topic", "filter", "ackDeadlineSeconds", "pushConfig",
     "pushEndpoint", "maxMessages", "ackIds", "labels", "policy", "bindings", "message", "encoding", "schema",
     "type", "definition", "updateMask", "subscription", "retryPolicy", "minimumBackoff", "messageTransform",
     "messageTransforms", "javascriptUdf", "code", "functionName", "compression", "disabled", "x"]
)  # fmt: skip
_JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["a!G!k=", "aGVs bG8=", "aGVsbG8=", "-_-_", "\\x0", "10s", "1e300s", FUZZ_TOPIC]),
)  # fmt: skip
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_FIELD_NAMES, inner, max_size=4),
    max_leaves=25,
)
_REST_BODIES = st.one_of(
    _JSON.map(lambda value: json.dumps(value).encode()),
    st.dictionaries(_FIELD_NAMES, _JSON, max_size=5).map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=100),
    st.tuples(st.sampled_from(["[", "{", '{"messages": [', '{"a": ', '"']), st.integers(1, 200_000)).map(
        lambda pair: (pair[0] * pair[1]).encode()
    ),
    st.sampled_from([b"null", b"1", b"true", b'"s"', b"[]", b"{}", b"", b"\xff\xfe"]),
)


def _rest(
    server: LocalServer, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        text = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


@examples(1500)
@given(
    route=st.sampled_from(_REST_ROUTES),
    body=_REST_BODIES,
    timeout=st.sampled_from([None, "1e300", "-1", "nan", "0.5", "x"]),
)
def test_rest_bodies(
    client: Client, server: LocalServer, route: tuple[str, str], body: bytes, timeout: str | None
) -> None:
    """Any body to any REST route: a documented 4xx in Google's JSON error form, never a 500."""
    CASES["REST body"] += 1
    method, path = route
    headers = {"Content-Type": "application/json"}
    if timeout is not None:
        headers["X-Server-Timeout"] = timeout
    status, document = _rest(server, method, path, body, headers)
    CODES[(f"REST {method}", str(status))] += 1
    assert status in REST_DOCUMENTED, f"{method} {path} answered {status}: {str(document)[:300]}"
    if status != 200:
        assert isinstance(document, dict) and document["error"]["status"] not in ("INTERNAL", "UNKNOWN"), (
            document
        )
    still = client.call("GetTopic", PB["GetTopicRequest"](topic=GOOD_TOPIC))
    assert still[0] == grpc.StatusCode.OK


_FILTER_PIECES = st.sampled_from(
    ["attributes", ".", ":", "a", "k", '"', "'", "\\", "x", "u", "U", "0", "1", "F", "D8", "00", "=", "!=",
     "(", ")", " ", "NOT ", "-", " AND ", " OR ", "hasPrefix(", ",", "é", "\x00"]
)  # fmt: skip


@examples(1500)
@given(pieces=st.lists(_FILTER_PIECES, max_size=40))
def test_filters(client: Client, pieces: list[str]) -> None:
    """Any filter text on CreateSubscription: created, or INVALID_ARGUMENT saying where; never INTERNAL."""
    CASES["filter"] += 1
    name = "projects/fuzz/subscriptions/filter-fuzz"
    request = PB["Subscription"](name=name, topic=FUZZ_TOPIC, filter="".join(pieces))
    code, details, _ = client.call("CreateSubscription", request)
    check_answer(client, "CreateSubscription", code, details)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.OK:
        client.ok("DeleteSubscription", PB["DeleteSubscriptionRequest"](subscription=name), empty_pb2.Empty)


@pytest.mark.parametrize(
    "path",
    [
        "/google.pubsub.v1.Publisher/NoSuchMethod",
        "/google.pubsub.v1.NoSuchService/Publish",
        "/google.pubsub.v2.Publisher/Publish",
        "/nonsense",
    ],
)
def test_unknown_methods_are_unimplemented(client: Client, path: str) -> None:
    CASES["unknown method"] += 1
    code, details, _ = client.raw(path, b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert details


def test_oversized_requests(client: Client) -> None:
    """Over the service's 10 MB limit: INVALID_ARGUMENT; over the gRPC frame limit: RESOURCE_EXHAUSTED."""
    CASES["oversized"] += 3
    exactly = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 9_999_900)])
    assert exactly.ByteSize() <= 10_000_000
    code, details, _ = client.call("Publish", exactly)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.OK, details
    over = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 10_000_001)])
    code, details, _ = client.call("Publish", over)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    huge = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 21_000_000)])
    code, details, _ = client.call("Publish", huge)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_dead_lettering_a_message_at_the_attribute_limit(client: Client, server: LocalServer) -> None:
    """A message with 100 attributes gains 4 when dead-lettered; it must still reach the dead-letter topic.

    Regression: the forwarded copy failed the 100-attribute request limit and vanished from the queue.
    """
    CASES["dead letter at the limit"] += 1
    source, dead = "projects/trust/topics/dl-source", "projects/trust/topics/dl-dead"
    subscription, dead_subscription = (
        "projects/trust/subscriptions/dl-source",
        "projects/trust/subscriptions/dl-dead",
    )
    for topic in (source, dead):
        client.ok("CreateTopic", PB["Topic"](name=topic), PB["Topic"])
    config = PB["Subscription"](name=subscription, topic=source)
    config.dead_letter_policy.dead_letter_topic = dead
    config.dead_letter_policy.max_delivery_attempts = 5
    client.ok("CreateSubscription", config, PB["Subscription"])
    client.ok(
        "CreateSubscription", PB["Subscription"](name=dead_subscription, topic=dead), PB["Subscription"]
    )
    attributes = {f"key-{index}": "v" for index in range(100)}
    message = PB["PubsubMessage"](data=b"at the limit", attributes=attributes)
    client.ok("Publish", PB["PublishRequest"](topic=source, messages=[message]), PB["PublishResponse"])
    pull = PB["PullRequest"](subscription=subscription, max_messages=10, return_immediately=True)
    for _ in range(5):
        received = client.ok("Pull", pull, PB["PullResponse"]).received_messages
        assert len(received) == 1
        nack = PB["ModifyAckDeadlineRequest"](
            subscription=subscription, ack_ids=[received[0].ack_id], ack_deadline_seconds=0
        )
        client.ok("ModifyAckDeadline", nack, PB["PullResponse"])
    assert client.ok("Pull", pull, PB["PullResponse"]).received_messages == []
    # Forwarding starts at the fifth nack, in the background; one waiting Pull must see it (an empty
    # answer here was a lost wake-up in the server's Pull, fixed since, not a slow disk).
    dead_pull = PB["PullRequest"](subscription=dead_subscription, max_messages=10)
    forwarded = list(client.ok("Pull", dead_pull, PB["PullResponse"]).received_messages)
    stored = [message.data for message in server.messages(dead)]
    assert forwarded, f"nothing reached the dead-letter subscription; the dead-letter topic holds {stored}"
    assert [received.message.data for received in forwarded] == [b"at the limit"]
    copied = dict(forwarded[0].message.attributes)
    assert {key: copied[key] for key in attributes} == attributes
    assert copied["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"


# ----------------------------------------------------------------------------- consistency
def _all_pages(client: Client, method: str, request: Any, response_class: Any, field: str) -> list[Any]:
    items: list[Any] = []
    while True:
        response = client.ok(method, request, response_class)
        items.extend(getattr(response, field))
        if not response.next_page_token:
            return items
        request.page_token = response.next_page_token


def _snapshot_of_state(client: Client) -> dict[str, Any]:
    """Every listed topic and subscription, checked against Get and against each other."""
    topics: dict[str, Any] = {}
    subscriptions: dict[str, Any] = {}
    for project in sorted(PROJECTS):
        for topic in _all_pages(
            client,
            "ListTopics",
            PB["ListTopicsRequest"](project=f"projects/{project}", page_size=7),
            PB["ListTopicsResponse"],
            "topics",
        ):
            assert client.ok("GetTopic", PB["GetTopicRequest"](topic=topic.name), PB["Topic"]) == topic
            topics[topic.name] = topic
        for subscription in _all_pages(
            client,
            "ListSubscriptions",
            PB["ListSubscriptionsRequest"](project=f"projects/{project}", page_size=7),
            PB["ListSubscriptionsResponse"],
            "subscriptions",
        ):
            got = client.ok(
                "GetSubscription",
                PB["GetSubscriptionRequest"](subscription=subscription.name),
                PB["Subscription"],
            )
            assert got == subscription
            subscriptions[subscription.name] = subscription
    assert len(set(topics)) == len(topics)
    for subscription in subscriptions.values():
        assert subscription.topic == DELETED_TOPIC or subscription.topic in topics, subscription
    for name in topics:
        attached = _all_pages(
            client,
            "ListTopicSubscriptions",
            PB["ListTopicSubscriptionsRequest"](topic=name, page_size=3),
            PB["ListTopicSubscriptionsResponse"],
            "subscriptions",
        )
        for subscription in attached:
            assert subscriptions[subscription].topic == name
            assert not subscriptions[subscription].detached
    return {"topics": topics, "subscriptions": subscriptions}


def _round_trip(client: Client, tag: str) -> None:
    topic, subscription = f"projects/trust/topics/round-{tag}", f"projects/trust/subscriptions/round-{tag}"
    client.ok("CreateTopic", PB["Topic"](name=topic), PB["Topic"])
    client.ok("CreateSubscription", PB["Subscription"](name=subscription, topic=topic), PB["Subscription"])
    message = PB["PubsubMessage"](data=b"still fine", attributes={"after": "fuzzing"})
    published = client.ok(
        "Publish", PB["PublishRequest"](topic=topic, messages=[message]), PB["PublishResponse"]
    )
    pulled = client.ok(
        "Pull", PB["PullRequest"](subscription=subscription, max_messages=10), PB["PullResponse"]
    ).received_messages
    assert [received.message.message_id for received in pulled] == list(published.message_ids)
    assert pulled[0].message.data == b"still fine"
    assert dict(pulled[0].message.attributes) == {"after": "fuzzing"}
    client.ok(
        "Acknowledge",
        PB["AcknowledgeRequest"](subscription=subscription, ack_ids=[pulled[0].ack_id]),
        PB["Topic"],
    )


def test_state_is_consistent_and_survives_a_restart(
    client: Client, server: LocalServer, data_dir: Path
) -> None:
    """Runs last: the fuzzed state is consistent, reloads identically from SQLite, and still works."""
    before = _snapshot_of_state(client)
    _round_trip(client, "before-restart")
    before = _snapshot_of_state(client)
    server.stop(0)
    with LocalServer(data_dir=data_dir) as restarted:
        again = Client(restarted.address)
        try:
            after = _snapshot_of_state(again)
            assert after == before
            _round_trip(again, "after-restart")
        finally:
            again.close()
    total = sum(CASES.values())
    print(f"\nbad input: {total} cases against one SQLite server")
    for name, count in sorted(CASES.items()):
        print(f"  {name}: {count}")
    by_code: Counter[str] = Counter()
    for (_, code), count in CODES.items():
        by_code[code] += count
    print("  answers by status: " + ", ".join(f"{code} {count}" for code, count in by_code.most_common()))
    print("  answers by method: " + ", ".join(f"{m} {c} x{n}" for (m, c), n in sorted(CODES.items())))
    print(
        f"  state after fuzzing: {len(before['topics'])} topics, "
        f"{len(before['subscriptions'])} subscriptions in {len(PROJECTS)} projects, identical after a restart"
    )
