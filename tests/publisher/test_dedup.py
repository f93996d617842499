"""Duplicates a consumer can drop: the idempotency key the publisher stamps, and ``hedgepub.dedup``."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
from google.cloud import pubsub_v1

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    Deduplicator,
    DedupStats,
    HedgingSettings,
    PublisherClient,
)
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.bench import AdminClient
from hedgepub.dedup import IDEMPOTENCY_ATTRIBUTE
from hedgepub.server import LocalServer
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import run_virtual, virtual_time

TOPIC = "projects/test-project/topics/topic"


@dataclass
class Delivered:
    """A delivered message as a consumer sees it: attributes, message ID, and whether it was acked."""

    message_id: str
    attributes: dict[str, str] = field(default_factory=dict)
    acked: bool = False

    def ack(self) -> None:
        self.acked = True


def keyed(key: str, message_id: str) -> Delivered:
    return Delivered(message_id, {IDEMPOTENCY_ATTRIBUTE: key})


# -- the publisher stamps one key per message, the same on every copy ------------------------------------


@virtual_time
async def test_every_copy_of_a_hedged_batch_carries_the_same_keys() -> None:
    transport = ScriptedTransport()
    publisher = AsyncPublisherClient(
        transport=transport,
        hedging_settings=HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2),
        batch_settings=BatchSettings(max_messages=3, max_latency=0.01),
        idempotency_attribute=True,
    )
    for _ in range(5):
        await publisher.publish(TOPIC, b"warm-up")
    transport.script.extend([transport.ok(delay=1.0), transport.ok(delay=0.01)])
    await asyncio.gather(
        publisher.publish(TOPIC, b"a"),
        publisher.publish(TOPIC, b"b", origin="app"),
        publisher.publish(TOPIC, b"c", **{IDEMPOTENCY_ATTRIBUTE: "the caller's own key"}),
    )
    original, hedge = transport.calls[-2:]
    assert decode_client_telemetry(hedge.metadata[CLIENT_TELEMETRY_KEY])[0] == 1

    def keys(call: object) -> list[str]:
        return [message.attributes[IDEMPOTENCY_ATTRIBUTE] for message in call.request.messages]  # type: ignore[attr-defined]

    assert keys(original) == keys(hedge)
    assert keys(original)[2] == "the caller's own key"
    assert dict(hedge.request.messages[1].attributes)["origin"] == "app"
    every_key = [key for call in transport.calls for key in keys(call)]
    assert len(set(every_key)) == len(every_key) - 3  # unique per message; only the hedge repeats them
    await publisher.shutdown()


@virtual_time
async def test_the_key_is_off_by_default_and_its_attribute_can_be_named() -> None:
    transport = ScriptedTransport()
    async with AsyncPublisherClient(transport=transport) as plain:
        await plain.publish(TOPIC, b"x")
    async with AsyncPublisherClient(transport=transport, idempotency_attribute="dedup-key") as named:
        await named.publish(TOPIC, b"y")
    assert dict(transport.calls[0].request.messages[0].attributes) == {}
    assert list(transport.calls[1].request.messages[0].attributes) == ["dedup-key"]


@pytest.mark.parametrize(
    ("value", "error"), [(5, TypeError), ("", ValueError), ("goog-key", ValueError), ("k" * 257, ValueError)]
)
def test_a_bad_attribute_name_is_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="idempotency_attribute"):
        PublisherClient(transport=ScriptedTransport(), idempotency_attribute=value)  # type: ignore[arg-type]


# -- the consumer's helper ----------------------------------------------------------------------------


def test_copies_are_dropped_redeliveries_and_unkeyed_messages_pass() -> None:
    dedup = Deduplicator()
    assert dedup.seen(keyed("k1", "100")) is False
    assert dedup.seen(keyed("k1", "101")) is True  # a hedged copy: another message ID
    assert dedup.seen(keyed("k1", "100")) is False  # the first copy redelivered after a nack
    assert dedup.seen(keyed("k2", "102")) is False
    assert dedup.seen(Delivered("103")) is False  # no key: cannot be told apart
    assert dedup.stats() == DedupStats(
        checked=5, passed=4, duplicates=1, redeliveries=1, unkeyed=1, forgotten=0, tracked=2
    )


def test_the_window_holds_at_most_max_ids_keys() -> None:
    dedup = Deduplicator(max_ids=3)
    for number in range(5):
        dedup.seen(keyed(f"k{number}", str(number)))
    assert len(dedup) == 3
    assert dedup.stats().forgotten == 2
    assert dedup.seen(keyed("k0", "copy")) is False  # forgotten: passed, and remembered again
    assert dedup.seen(keyed("k4", "copy")) is True


def test_keys_older_than_max_age_are_forgotten() -> None:
    async def scenario() -> tuple[bool, bool, DedupStats]:
        dedup = Deduplicator(max_age=60.0)
        dedup.seen(keyed("old", "1"))
        await asyncio.sleep(30)
        dedup.seen(keyed("young", "2"))
        await asyncio.sleep(45)  # "old" is 75 s old, "young" 45 s
        return dedup.seen(keyed("old", "3")), dedup.seen(keyed("young", "4")), dedup.stats()

    old_copy_dropped, young_copy_dropped, stats = run_virtual(scenario())
    assert (old_copy_dropped, young_copy_dropped) == (False, True)
    assert (stats.forgotten, stats.tracked) == (1, 2)


def test_the_helper_is_exact_under_threads() -> None:
    dedup = Deduplicator(max_ids=10_000)
    keys = 2_000
    # Every key arrives in three copies with their own message IDs, spread over eight threads.
    copies = [keyed(f"key-{number}", f"{number}-{copy}") for number in range(keys) for copy in range(3)]
    random.Random(7).shuffle(copies)
    passed: list[list[Delivered]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def consume(index: int) -> None:
        start.wait()
        for message in copies[index::8]:
            if not dedup.seen(message):
                passed[index].append(message)

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first_copies = [message.attributes[IDEMPOTENCY_ATTRIBUTE] for batch in passed for message in batch]
    assert sorted(first_copies) == sorted(f"key-{number}" for number in range(keys))
    stats = dedup.stats()
    assert (stats.checked, stats.passed, stats.duplicates, stats.tracked) == (3 * keys, keys, 2 * keys, keys)


def test_wrap_acks_copies_without_calling_the_callback() -> None:
    dedup = Deduplicator()
    handled: list[str] = []
    callback = dedup.wrap(lambda message: handled.append(message.message_id))
    first, copy = keyed("k", "1"), keyed("k", "2")
    callback(first)
    callback(copy)
    assert handled == ["1"]
    assert (first.acked, copy.acked) == (False, True)  # the first is the callback's to ack


def test_the_official_subscriber_gets_one_copy_through_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    subscription = "projects/test-project/subscriptions/dedup"
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
            admin.create_subscription(subscription, TOPIC)
        with PublisherClient(endpoint=server.address, idempotency_attribute=True) as publisher:
            first_id = publisher.publish(TOPIC, b"once").result(timeout=10)
            stored_key = server.messages(TOPIC)[0].attributes[IDEMPOTENCY_ATTRIBUTE]
            # A copy stored as a hedge that lost the race would be: same key, its own message ID.
            copy_id = publisher.publish(TOPIC, b"once", **{IDEMPOTENCY_ATTRIBUTE: stored_key}).result(10)
            publisher.publish(TOPIC, b"another").result(timeout=10)
        assert copy_id != first_id
        dedup = Deduplicator()
        received: list[bytes] = []
        done = threading.Event()

        def callback(message: pubsub_v1.subscriber.message.Message) -> None:
            received.append(message.data)
            message.ack()
            if len(received) == 2:
                done.set()

        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        subscriber = pubsub_v1.SubscriberClient()
        with subscriber:
            future = subscriber.subscribe(subscription, dedup.wrap(callback))
            assert done.wait(timeout=20)
            deadline = time.monotonic() + 5
            while dedup.stats().checked < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            future.cancel()
            future.result(timeout=10)
    assert sorted(received) == [b"another", b"once"]
    assert dedup.stats().duplicates == 1
