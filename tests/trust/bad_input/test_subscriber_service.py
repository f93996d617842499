"""Bad input to the Subscriber service over raw gRPC: the subscription admin RPCs, Pull, acks and
deadlines, StreamingPull, filters and dead-lettering at the limits.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import empty_pb2
from hypothesis import given
from hypothesis import strategies as st

from hedgepub.server import LocalServer
from hedgepub.server._methods import METHODS

from ._common import (
    _PUSH_ENDPOINT,
    CASES,
    FUZZ_SUBSCRIPTION,
    FUZZ_TOPIC,
    PB,
    PROJECTS,
    Client,
    _ack_ids,
    _deadlines,
    _int32,
    _masks,
    _page_tokens,
    _project_names,
    _subscription_bodies,
    _subscriptions,
    _text,
    check_answer,
    examples,
    mostly,
    names,
)


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
