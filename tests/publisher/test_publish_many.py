"""``publish_many`` on both clients, against the real local server (in memory, ephemeral port).

``HEDGEPUB_PUBLISH_MANY_MESSAGES`` sets the size of the large call (20,000 by default; 1,000,000 for a
long run).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from google.pubsub_v1.types import PubsubMessage

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    FlowControlLimitError,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    OrderingKeyPausedError,
    PublisherClient,
    PublishManyError,
    RpcError,
    StatusCode,
)
from hedgepub._transport.grpc import PubsubMessagePb
from hedgepub.bench import AdminClient
from hedgepub.server import FaultRule, LocalServer

PAYLOADS_40 = [b"m%d" % index for index in range(40)]
LARGE = int(os.environ.get("HEDGEPUB_PUBLISH_MANY_MESSAGES", "20000"))


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def stored_by_id(server: LocalServer, topic: str) -> dict[str, bytes]:
    """What the server stored for ``topic``: message ID -> data. (Batches in flight together may be
    stored in either order, so the IDs' order is the call's, not necessarily the store's.)"""
    return {m.message_id: m.data for m in server.messages(topic)}


def test_data_alone_in_order_with_ids_as_stored(server: LocalServer, topic: str) -> None:
    payloads = [b"message %d" % index for index in range(1_050)]  # lengths differ: 9 to 12 bytes
    with PublisherClient() as publisher:
        ids = publisher.publish_many(topic, payloads).result(timeout=30)
    assert stored_by_id(server, topic) == dict(zip(ids, payloads, strict=True))
    stats = publisher.stats()
    assert (stats.messages_published, stats.messages_failed) == (1_050, 0)
    assert stats.batches_sent == 11  # 100 per batch, as publish() fills them


def test_every_shape_of_message(server: LocalServer, topic: str) -> None:
    messages = [
        b"plain",
        (b"tuple", {"kind": "tuple"}),
        (b"tuple, no attributes", {}),
        PubsubMessage(data=b"proto-plus", attributes={"kind": "proto-plus"}),
        PubsubMessagePb(data=b"raw protobuf", attributes={"kind": "raw"}),
        (b"bytes value", {"kind": b"utf-8 bytes"}),
    ]
    with PublisherClient() as publisher:
        ids = publisher.publish_many(topic, messages).result(timeout=30)
    stored = server.messages(topic)
    assert [m.message_id for m in stored] == ids
    assert [(m.data, dict(m.attributes)) for m in stored] == [
        (b"plain", {}),
        (b"tuple", {"kind": "tuple"}),
        (b"tuple, no attributes", {}),
        (b"proto-plus", {"kind": "proto-plus"}),
        (b"raw protobuf", {"kind": "raw"}),
        (b"bytes value", {"kind": "utf-8 bytes"}),
    ]


def test_mixed_with_publish_keeps_the_order_of_the_calls(server: LocalServer, topic: str) -> None:
    with PublisherClient() as publisher:
        first = publisher.publish(topic, b"first")
        many = publisher.publish_many(topic, [b"many %d" % index for index in range(250)])
        last = publisher.publish(topic, b"last")
        ids = [first.result(timeout=30), *many.result(timeout=30), last.result(timeout=30)]
    expected = [b"first", *(b"many %d" % index for index in range(250)), b"last"]
    assert stored_by_id(server, topic) == dict(zip(ids, expected, strict=True))


def test_empty_call_gives_no_ids(topic: str) -> None:
    with PublisherClient() as publisher:
        assert publisher.publish_many(topic, []).result(timeout=10) == []
    assert publisher.stats().batches_sent == 0


@pytest.mark.parametrize(
    ("messages", "error", "text"),
    [
        ([b"ok", "text"], TypeError, "messages[1]: a message is bytes"),
        ([b"ok", (b"x", {"n": 1})], TypeError, "messages[1]: attribute 'n' must be a str"),
        ([b"ok", (b"x",)], TypeError, "messages[1]: a message tuple is (data, attributes)"),
        ([b"ok", b"ok", ("text", {})], TypeError, "messages[2]: data must be bytes"),
        ([PubsubMessage(data=b"x", ordering_key="k")], ValueError, "messages[0]: ordering_key given"),
        ([b"x" * 11_000_000], ValueError, "messages[0]: the message is"),
        ([b"ok", b""], ValueError, "messages[1]: the message is empty"),
        ([b"ok", (b"", {})], ValueError, "messages[1]: the message is empty"),
        ([b"ok", PubsubMessage()], ValueError, "messages[1]: the message is empty"),
        (b"not a list", TypeError, "messages must be a sequence of messages"),
    ],
)
def test_bad_input_is_refused_at_once_and_nothing_is_published(
    server: LocalServer, topic: str, messages: object, error: type[Exception], text: str
) -> None:
    with PublisherClient() as publisher:
        with pytest.raises(error) as caught:
            publisher.publish_many(topic, messages)  # type: ignore[arg-type]
        assert text in str(caught.value)
    assert server.messages(topic) == []
    assert publisher.stats().batches_sent == 0


def test_empty_data_with_an_attribute_is_published(server: LocalServer, topic: str) -> None:
    with PublisherClient() as publisher:
        ids = publisher.publish_many(topic, [b"ok", (b"", {"kind": "marker"})]).result(timeout=30)
    stored = {m.message_id: (m.data, dict(m.attributes)) for m in server.messages(topic)}
    assert stored == {ids[0]: (b"ok", {}), ids[1]: (b"", {"kind": "marker"})}


def test_empty_publish_is_refused_alone_and_its_batch_mates_are_published(
    server: LocalServer, topic: str
) -> None:
    """The service refuses a request holding an empty message whole: refused at the call, it cannot
    fail the messages batched beside it."""
    with PublisherClient() as publisher:
        before = publisher.publish(topic, b"before")
        with pytest.raises(ValueError, match="the message is empty"):
            publisher.publish(topic, b"")
        after = publisher.publish(topic, b"after")
        ids = [before.result(timeout=30), after.result(timeout=30)]
    assert stored_by_id(server, topic) == dict(zip(ids, [b"before", b"after"], strict=True))
    assert publisher.stats().messages_failed == 0


@pytest.mark.parametrize(
    ("attributes", "ordering_key", "text"),
    [
        ({f"k{n}": "v" for n in range(101)}, "", "101 attributes"),
        ({"": "v"}, "", "keys must not be empty"),
        ({"k" * 257: "v"}, "", "257 bytes"),
        ({"\u00e9" * 129: "v"}, "", "258 bytes"),  # 129 characters, 258 bytes in UTF-8
        ({"k": "v" * 1025}, "", "1025 bytes"),
        ({"googKey": "v"}, "", "starts with 'goog'"),
        ({"GOOG_key": "v"}, "", "starts with 'goog'"),
        ({}, "k" * 1025, "the ordering key is 1025 bytes"),
    ],
)
def test_what_the_service_refuses_fails_alone(
    server: LocalServer, topic: str, attributes: dict[str, str], ordering_key: str, text: str
) -> None:
    """A message the service would refuse (and with it its whole request) is refused at the call; the
    messages batched beside it are published."""
    with PublisherClient(enable_message_ordering=True) as publisher:
        before = publisher.publish(topic, b"before")
        with pytest.raises(ValueError) as caught:
            publisher.publish(topic, b"x", ordering_key, **attributes)
        assert text in str(caught.value)
        with pytest.raises(ValueError) as caught_many:
            publisher.publish_many(topic, [b"ok", (b"x", attributes)], ordering_key)
        where = "messages[0]: " if ordering_key else "messages[1]: "  # the call's key is every message's
        assert str(caught_many.value).startswith(where) and text in str(caught_many.value)
        ids = [before.result(timeout=30), publisher.publish(topic, b"after").result(timeout=30)]
    assert stored_by_id(server, topic) == dict(zip(ids, [b"before", b"after"], strict=True))


def test_the_limits_themselves_are_published(server: LocalServer, topic: str) -> None:
    attributes = {f"k{n}": "v" for n in range(98)}  # 100 with the two below
    attributes["k" * 256] = "v" * 1024
    attributes["googclient_marker"] = "the clients' own prefix"
    with PublisherClient(enable_message_ordering=True) as publisher:
        message_id = publisher.publish(topic, b"", "o" * 1024, **attributes).result(timeout=30)
    (stored,) = server.messages(topic)
    assert (stored.message_id, dict(stored.attributes), stored.ordering_key) == (
        message_id,
        attributes,
        "o" * 1024,
    )


def test_async_empty_publish_is_refused(server: LocalServer, topic: str) -> None:
    async def main() -> None:
        async with AsyncPublisherClient() as publisher:
            with pytest.raises(ValueError, match="the message is empty"):
                await publisher.publish(topic, b"")
            assert await publisher.publish(topic, b"x", kind="y")

    asyncio.run(main())


def test_every_message_fails_with_the_batch_error(server: LocalServer) -> None:
    with PublisherClient() as publisher:
        future = publisher.publish_many("projects/test-project/topics/missing", [b"a", b"b", b"c"])
        with pytest.raises(PublishManyError) as caught:
            future.result(timeout=10)
    error = caught.value
    assert error.message_ids == [None, None, None]
    assert sorted(error.errors) == [0, 1, 2]
    assert all(isinstance(cause, RpcError) for cause in error.errors.values())
    assert error.code is StatusCode.NOT_FOUND
    assert "3 of the 3 messages of publish_many failed" in str(error)
    assert publisher.stats().messages_failed == 3


def test_one_failed_batch_leaves_the_others_published(server: LocalServer, topic: str) -> None:
    # Two batches of the call: the first sent while the server refuses, the second after.
    with PublisherClient(batch_settings=BatchSettings(max_messages=3)) as publisher:
        server.faults.set("Publish", FaultRule(errors={StatusCode.PERMISSION_DENIED: 1.0}))
        first = publisher.publish_many(topic, [b"a", b"b", b"c"])
        with pytest.raises(PublishManyError):
            first.result(timeout=10)
        server.faults.set("Publish", None)
        both = publisher.publish_many(topic, [b"d", b"e", b"f", b"g"])
        ids = both.result(timeout=10)
    assert stored_by_id(server, topic) == dict(zip(ids, [b"d", b"e", b"f", b"g"], strict=True))


def test_partial_failure_names_the_failed_messages(server: LocalServer, topic: str) -> None:
    release = threading.Event()
    with PublisherClient(batch_settings=BatchSettings(max_messages=2)) as publisher:
        server.faults.set("Publish", FaultRule(latency="100%:5s"))
        future = publisher.publish_many(topic, [b"a", b"b", b"c", b"d", b"e"])
        wait_for(lambda: server.faults.counts["Publish"].delayed >= 1)
        server.faults.set("Publish", None)
        release.set()
        publisher.shutdown(timeout=0.5)  # the delayed batches are cut off; none reached the store
    with pytest.raises(PublishManyError) as caught:
        future.result(timeout=10)
    error = caught.value
    published = [index for index, message_id in enumerate(error.message_ids) if message_id is not None]
    assert sorted([*published, *error.errors]) == [0, 1, 2, 3, 4]
    assert {m.message_id for m in server.messages(topic)} == {error.message_ids[i] for i in published}
    stats = publisher.stats()
    assert stats.messages_published + stats.messages_failed == 5
    assert stats.messages_failed == len(error.errors)


def test_ordering_keys_in_order_per_key(server: LocalServer, topic: str) -> None:
    messages = [PubsubMessage(data=b"a%d" % index, ordering_key="a") for index in range(150)]
    messages += [(b"b%d" % index, {"n": str(index)}) for index in range(150)]  # the call's key: "b"
    with PublisherClient(enable_message_ordering=True) as publisher:
        ids = publisher.publish_many(topic, messages, ordering_key="b").result(timeout=30)
    stored = server.messages(topic)
    assert sorted(m.message_id for m in stored) == sorted(ids)
    by_key = {key: [m.data for m in stored if m.ordering_key == key] for key in ("a", "b")}
    assert by_key == {
        "a": [b"a%d" % index for index in range(150)],
        "b": [b"b%d" % index for index in range(150)],
    }
    assert {m.message_id: m.data for m in stored} == dict(
        zip(ids, (m[0] if isinstance(m, tuple) else m.data for m in messages), strict=True)
    )


def test_paused_ordering_key_fails_its_messages(server: LocalServer, topic: str) -> None:
    with PublisherClient(enable_message_ordering=True) as publisher:
        server.faults.set("Publish", FaultRule(errors={StatusCode.PERMISSION_DENIED: 1.0}))
        with pytest.raises(RpcError):
            publisher.publish(topic, b"fails", ordering_key="k").result(timeout=10)
        server.faults.set("Publish", None)
        future = publisher.publish_many(topic, [b"x", b"y"], ordering_key="k")
        with pytest.raises(PublishManyError) as caught:
            future.result(timeout=10)
        assert all(isinstance(error, OrderingKeyPausedError) for error in caught.value.errors.values())
        publisher.resume_publish(topic, "k")
        assert len(publisher.publish_many(topic, [b"x", b"y"], ordering_key="k").result(timeout=10)) == 2


def test_flow_control_admits_message_by_message(server: LocalServer, topic: str) -> None:
    flow = FlowControlSettings(message_limit=10, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    with PublisherClient(flow_control=flow) as publisher:
        payloads = [b"m%d" % index for index in range(95)]
        ids = publisher.publish_many(topic, payloads).result(timeout=30)
    assert stored_by_id(server, topic) == dict(zip(ids, payloads, strict=True))
    assert publisher.stats().messages_published == 95


def test_flow_control_error_fails_the_rest(server: LocalServer, topic: str) -> None:
    flow = FlowControlSettings(message_limit=3, limit_exceeded_behavior=LimitExceededBehavior.ERROR)
    server.faults.set("Publish", FaultRule(latency="100%:300ms"))
    with PublisherClient(flow_control=flow) as publisher:
        future = publisher.publish_many(topic, [b"a", b"b", b"c", b"d", b"e"])
        with pytest.raises(PublishManyError) as caught:
            future.result(timeout=10)
    error = caught.value
    assert stored_by_id(server, topic) == dict(zip(error.message_ids[:3], [b"a", b"b", b"c"], strict=True))
    assert sorted(error.errors) == [3, 4]
    assert all(isinstance(cause, FlowControlLimitError) for cause in error.errors.values())


def test_hedged_call_is_published_once(server: LocalServer, topic: str) -> None:
    hedging = HedgingSettings(hedge_delay=0.2, max_tokens=1, refill_ratio=0.2)
    with PublisherClient(hedging_settings=hedging) as publisher:
        for _ in range(5):  # fill the bucket
            publisher.publish(topic, b"warm-up").result(timeout=10)
        server.faults.set("Publish", FaultRule(latency="100%:3s"))
        future = publisher.publish_many(topic, [b"hedged %d" % index for index in range(10)])
        wait_for(lambda: server.faults.counts["Publish"].delayed == 1)
        server.faults.set("Publish", None)  # the original waits out its delay; the hedge goes through
        ids = future.result(timeout=10)
        wait_for(lambda: server.faults.counts["Publish"].cancelled_during_delay == 1)
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_won) == (1, 1)
    stored = {m.message_id: m.data for m in server.messages(topic) if m.data.startswith(b"hedged")}
    assert stored == dict(zip(ids, (b"hedged %d" % index for index in range(10)), strict=True))


def test_idempotency_keys_are_stamped(server: LocalServer, topic: str) -> None:
    with PublisherClient(idempotency_attribute=True) as publisher:
        ids = publisher.publish_many(topic, [b"a", (b"b", {"kept": "yes"})]).result(timeout=10)
    stored = server.messages(topic)
    assert [m.message_id for m in stored] == ids
    keys = [m.attributes["hedgepub-idempotency-key"] for m in stored]
    assert len(set(keys)) == 2
    assert stored[1].attributes["kept"] == "yes"


def test_refused_after_shutdown(topic: str) -> None:
    publisher = PublisherClient()
    publisher.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        publisher.publish_many(topic, [b"x"])


def test_threads_calling_at_once(server: LocalServer, topic: str) -> None:
    results: list[list[str]] = []
    with PublisherClient() as publisher:

        def work(number: int) -> None:
            payloads = [b"%d-%d" % (number, index) for index in range(1_000)]
            results.append(publisher.publish_many(topic, payloads).result(timeout=60))

        workers = [threading.Thread(target=work, args=(number,)) for number in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    stored = server.messages(topic)
    assert sorted(m.message_id for m in stored) == sorted(i for ids in results for i in ids)
    assert publisher.stats().messages_published == 4_000


def test_large_call(server: LocalServer, topic: str) -> None:
    payloads = [b"x" * 100] * LARGE
    with PublisherClient() as publisher:
        ids = publisher.publish_many(topic, payloads).result(timeout=max(60, LARGE / 2_000))
    assert len(ids) == len(set(ids)) == LARGE
    stored = server.messages(topic)
    assert sorted(m.message_id for m in stored) == sorted(ids)
    assert publisher.stats().messages_published == LARGE


def test_async_client(server: LocalServer, admin: AdminClient, topic: str) -> None:
    async def main() -> tuple[list[str], list[str]]:
        async with AsyncPublisherClient() as publisher:
            plain = await publisher.publish_many(topic, [b"m%d" % index for index in range(230)])
            mixed = await publisher.publish_many(topic, [b"a", (b"b", {"k": "v"}), PubsubMessage(data=b"c")])
            return plain, mixed

    plain, mixed = asyncio.run(main())
    expected = [*(b"m%d" % index for index in range(230)), b"a", b"b", b"c"]
    assert stored_by_id(server, topic) == dict(zip([*plain, *mixed], expected, strict=True))


def test_async_client_with_flow_control_and_failure(server: LocalServer, topic: str) -> None:
    flow = FlowControlSettings(message_limit=7, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)

    async def main() -> list[str]:
        async with AsyncPublisherClient(flow_control=flow) as publisher:
            ids = await publisher.publish_many(topic, PAYLOADS_40)
            with pytest.raises(PublishManyError) as caught:
                await publisher.publish_many("projects/test-project/topics/missing", [b"a", b"b"])
            assert sorted(caught.value.errors) == [0, 1]
            return ids

    ids = asyncio.run(main())
    assert stored_by_id(server, topic) == dict(zip(ids, PAYLOADS_40, strict=True))
