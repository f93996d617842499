"""Bad input to the Publisher service over raw gRPC: Publish and the topic admin RPCs."""

from __future__ import annotations

from typing import Any

import grpc
from hypothesis import given
from hypothesis import strategies as st

from hedgepub.server import LocalServer

from ._common import (
    CASES,
    PB,
    PROJECTS,
    Client,
    _int32,
    _masks,
    _page_tokens,
    _project_names,
    _publish_requests,
    _topic_bodies,
    _topics,
    check_answer,
    examples,
    names,
)


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
