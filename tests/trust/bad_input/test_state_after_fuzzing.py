"""After every other bad-input test (the package's conftest orders it last): the fuzzed state is
consistent, reloads identically from SQLite, and a round trip still works.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hedgepub.server import LocalServer

from ._common import (
    CASES,
    CODES,
    DELETED_TOPIC,
    PB,
    PROJECTS,
    Client,
)


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
