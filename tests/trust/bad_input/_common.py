"""The bad-input tests' shared parts: the raw gRPC client, the documented status codes, the request
strategies and the counts of cases and answers that the last test prints.
"""

from __future__ import annotations

import base64
import os
from collections import Counter
from typing import Any

import grpc
from google.iam.v1 import policy_pb2
from google.protobuf import duration_pb2, field_mask_pb2
from google.pubsub_v1.types import pubsub
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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
