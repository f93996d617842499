"""Both clients against the real local server (in memory, ephemeral port), with injected faults."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Mapping

import pytest

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    FlowControlLimitError,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    OrderingKeyPausedError,
    PublisherClient,
    RetrySettings,
    RpcError,
    ShutdownTimeoutError,
    StatusCode,
)
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.bench import AdminClient
from hedgepub.server import FaultInjector, FaultRule, LocalServer

QUICK_RETRY = RetrySettings(initial_retry_delay=0.01, retry_delay_multiplier=1.0, initial_rpc_timeout=2.0)


def attempt_of(metadata: Mapping[str, str]) -> int:
    """The hedged_attempt_count of the x-goog-pubsub-client-telemetry header in ``metadata``."""
    return decode_client_telemetry(metadata[CLIENT_TELEMETRY_KEY])[0]


def wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def publish_calls(server: LocalServer) -> int:
    counts = server.faults.counts
    return counts["Publish"].calls if "Publish" in counts else 0


def test_publish_and_pull_back(
    server: LocalServer, admin: AdminClient, topic: str, subscription: str
) -> None:
    with PublisherClient() as publisher:
        futures = [publisher.publish(topic, b"message %d" % i, index=str(i)) for i in range(25)]
        ids = [future.result(timeout=10) for future in futures]
    assert len(set(ids)) == 25
    pulled = [received.message for received in admin.pull(subscription, 1000, wait=10)]
    assert sorted(m.data for m in pulled) == sorted(b"message %d" % i for i in range(25))
    assert {m.message_id: m.attributes["index"] for m in pulled} == {ids[i]: str(i) for i in range(25)}
    stored = server.messages(topic)
    assert [m.message_id for m in stored] == ids


def test_official_subscriber_reads_what_was_published(server: LocalServer, topic: str) -> None:
    from google.cloud import pubsub_v1

    subscriber = pubsub_v1.SubscriberClient()
    subscription = topic.replace("/topics/", "/subscriptions/") + "-official"
    subscriber.create_subscription(name=subscription, topic=topic)
    with PublisherClient() as publisher:
        message_id = publisher.publish(topic, b"hello", lang="en").result(timeout=10)
    response = subscriber.pull(subscription=subscription, max_messages=10, timeout=10)
    subscriber.close()
    [received] = response.received_messages
    assert (received.message.message_id, received.message.data) == (message_id, b"hello")
    assert dict(received.message.attributes) == {"lang": "en"}


def test_batches_split_by_count(server: LocalServer, topic: str) -> None:
    # A latency far longer than the wait: the full batches resolve only if they did not wait for it.
    with PublisherClient(batch_settings=BatchSettings(max_messages=10, max_latency=600.0)) as publisher:
        futures = [publisher.publish(topic, b"x") for _ in range(35)]
        [future.result(timeout=60) for future in futures[:30]]
        assert not any(future.done() for future in futures[30:])  # the open batch waits for its latency
    stats = publisher.stats()
    assert (stats.batches_sent, stats.messages_published) == (4, 35)
    assert len(server.messages(topic)) == 35


def test_large_messages_go_in_batches_under_the_request_limit(server: LocalServer, topic: str) -> None:
    with PublisherClient() as publisher:
        futures = [publisher.publish(topic, bytes(3_000_000)) for _ in range(5)]
        assert all(future.result(timeout=30) for future in futures)
    assert publisher.stats().batches_sent == 5  # the default max_bytes (1 MB) sends each alone
    with PublisherClient(batch_settings=BatchSettings(max_bytes=10_000_000)) as publisher:
        futures = [publisher.publish(topic, bytes(3_000_000)) for _ in range(5)]
        assert all(future.result(timeout=30) for future in futures)
    assert publisher.stats().batches_sent == 2  # three fit a request, never four


def test_retries_on_injected_unavailable(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(errors={StatusCode.UNAVAILABLE: 1.0}))
    with PublisherClient(retry_settings=QUICK_RETRY) as publisher:
        future = publisher.publish(topic, b"x")
        wait_for(lambda: publish_calls(server) >= 3)
        server.faults.set("Publish", None)
        assert future.result(timeout=10)
    assert publisher.stats().attempts_sent >= 3
    assert len(server.messages(topic)) == 1


def test_missing_topic_fails_fast_with_not_found(server: LocalServer) -> None:
    with PublisherClient() as publisher:
        future = publisher.publish("projects/test-project/topics/missing-topic", b"x")
        with pytest.raises(RpcError) as caught:
            future.result(timeout=30)
    assert caught.value.code is StatusCode.NOT_FOUND
    assert publisher.stats().attempts_sent == 1  # fast: not retried


def fill_bucket(publisher: PublisherClient, topic: str, batches: int) -> None:
    for _ in range(batches):
        publisher.publish(topic, b"warm-up").result(timeout=10)


def test_hedge_wins_when_the_server_is_slow_and_the_loser_is_cancelled(
    server: LocalServer, topic: str
) -> None:
    hedging = HedgingSettings(hedge_delay=0.2, max_tokens=1, refill_ratio=0.2)
    with PublisherClient(hedging_settings=hedging) as publisher:
        fill_bucket(publisher, topic, 5)
        # A delay far longer than the wait below: only the hedge can answer within it.
        server.faults.set("Publish", FaultRule(latency="100%:120s"))
        future = publisher.publish(topic, b"hedged")
        wait_for(lambda: server.faults.counts["Publish"].delayed == 1)
        server.faults.set("Publish", None)  # the original is stuck in its delay; the hedge goes through
        message_id = future.result(timeout=30)
        wait_for(lambda: server.faults.counts["Publish"].cancelled_during_delay == 1)
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_won) == (1, 1)
    stored = [m for m in server.messages(topic) if m.data == b"hedged"]
    assert [m.message_id for m in stored] == [message_id]  # the cancelled loser stored nothing: no duplicate


class MetadataRecorder(FaultInjector):
    """The server's own fault injector, also noting the metadata of every Publish call that arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.publish_metadata: list[dict[str, str]] = []

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        if handler_call_details.method == "/google.pubsub.v1.Publisher/Publish":
            self.publish_metadata.append(dict(handler_call_details.invocation_metadata))
        return await super().intercept_service(continuation, handler_call_details)


def test_retries_and_hedges_carry_the_batch_metadata_on_the_wire() -> None:
    recorder = MetadataRecorder()
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    retry = RetrySettings(initial_retry_delay=0.03, retry_delay_multiplier=1.0, initial_rpc_timeout=2.0)
    topic = "projects/test-project/topics/metadata"
    with LocalServer(in_memory=True, faults=recorder) as server, AdminClient(server.address) as admin:
        admin.create_topic(topic)
        with PublisherClient(
            hedging_settings=hedging, retry_settings=retry, endpoint=server.address
        ) as publisher:
            fill_bucket(publisher, topic, 5)
            recorder.publish_metadata.clear()
            recorder.set("Publish", FaultRule(errors={StatusCode.UNAVAILABLE: 1.0}))
            future = publisher.publish(topic, b"retried and hedged")
            wait_for(lambda: any(attempt_of(call) == 1 for call in recorder.publish_metadata))
            recorder.set("Publish", None)  # the next retry of the original goes through
            message_id = future.result(timeout=10)
        assert [stored.message_id for stored in server.messages(topic)][-1:] == [message_id]
    calls = recorder.publish_metadata
    attempts = [attempt_of(call) for call in calls]
    assert attempts.count(1) == 1 and attempts.count(0) >= 2  # the original, its retries (one won)
    assert attempts[-1] == 0 and set(attempts) == {0, 1}
    starts = {decode_client_telemetry(call[CLIENT_TELEMETRY_KEY])[1] for call in calls}
    assert len(starts) == 1 and None not in starts  # one start time, the batch's, on every attempt
    assert len({call["hedgepub-batch-id"] for call in calls}) == 1
    assert all(call["x-goog-request-params"] == f"topic={topic}" for call in calls)


def test_no_hedge_when_the_bucket_is_empty(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:300ms"))
    with PublisherClient(hedging_settings=HedgingSettings(hedge_delay=0.1)) as publisher:
        publisher.publish(topic, b"x").result(timeout=10)
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_skipped, stats.attempts_sent) == (0, 1, 1)


def test_hedging_stops_by_itself_under_sustained_slowness(server: LocalServer, topic: str) -> None:
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    with PublisherClient(hedging_settings=hedging) as publisher:
        fill_bucket(publisher, topic, 5)
        server.faults.set("Publish", FaultRule(latency="100%:250ms"))
        for _ in range(4):
            publisher.publish(topic, b"slow").result(timeout=10)
    stats = publisher.stats()
    assert stats.hedges_sent == 1  # the one token; four slow successes refill less than another
    assert stats.hedges_skipped >= 3
    # Every hedge that lost to the original and was committed before its cancellation is a duplicate.
    slow = [m for m in server.messages(topic) if m.data == b"slow"]
    assert 4 <= len(slow) <= 4 + stats.hedges_sent


def test_ordering_keys_in_order_paused_and_resumed(server: LocalServer, topic: str) -> None:
    settings = BatchSettings(max_messages=3)
    with PublisherClient(batch_settings=settings, enable_message_ordering=True) as publisher:
        futures = [publisher.publish(topic, b"%d" % i, ordering_key="key") for i in range(20)]
        concurrent.futures.wait(futures, timeout=10)
        assert [m.data for m in server.messages(topic)] == [b"%d" % i for i in range(20)]

        server.faults.set("Publish", FaultRule(errors={StatusCode.PERMISSION_DENIED: 1.0}))
        failed = publisher.publish(topic, b"fails", ordering_key="key")
        with pytest.raises(RpcError):
            failed.result(timeout=10)
        server.faults.set("Publish", None)
        with pytest.raises(OrderingKeyPausedError):
            publisher.publish(topic, b"refused", ordering_key="key").result(timeout=10)
        assert publisher.publish(topic, b"other", ordering_key="other-key").result(timeout=10)
        publisher.resume_publish(topic, "key")
        assert publisher.publish(topic, b"resumed", ordering_key="key").result(timeout=10)


def test_flow_control_ignore_lets_everything_through(server: LocalServer, topic: str) -> None:
    flow = FlowControlSettings(message_limit=1, limit_exceeded_behavior=LimitExceededBehavior.IGNORE)
    with PublisherClient(flow_control=flow) as publisher:
        futures = [publisher.publish(topic, b"x") for _ in range(50)]
        assert all(future.result(timeout=10) for future in futures)


def test_flow_control_error_raises_at_the_limit(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:200ms"))
    flow = FlowControlSettings(
        message_limit=5, byte_limit=1000, limit_exceeded_behavior=LimitExceededBehavior.ERROR
    )
    with PublisherClient(flow_control=flow) as publisher:
        futures = [publisher.publish(topic, b"x") for _ in range(5)]
        with pytest.raises(FlowControlLimitError):
            publisher.publish(topic, b"one too many")
        assert all(future.result(timeout=10) for future in futures)
        assert publisher.publish(topic, b"room again").result(timeout=10)
        with pytest.raises(FlowControlLimitError):
            publisher.publish(topic, bytes(1001))  # larger than the byte limit: never fits


def test_flow_control_block_blocks_the_calling_thread(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:300ms"))
    flow = FlowControlSettings(message_limit=2, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    with PublisherClient(flow_control=flow, batch_settings=BatchSettings(max_latency=5)) as publisher:
        first = [publisher.publish(topic, b"x") for _ in range(2)]
        started = time.monotonic()
        third = publisher.publish(topic, b"waits")  # blocks until the first two are answered
        assert time.monotonic() - started >= 0.25
        assert all(future.done() for future in first)
        assert third.result(timeout=10)


def test_publishing_from_many_threads(server: LocalServer, topic: str) -> None:
    with PublisherClient() as publisher:
        futures: list[concurrent.futures.Future[str]] = []
        lock = threading.Lock()

        def work(thread: int) -> None:
            mine = [publisher.publish(topic, b"%d-%d" % (thread, i)) for i in range(500)]
            with lock:
                futures.extend(mine)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ids = [future.result(timeout=10) for future in futures]
    assert len(set(ids)) == 2000 == len(server.messages(topic))


def test_shutdown_waits_for_every_message(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:200ms"))
    publisher = PublisherClient(batch_settings=BatchSettings(max_latency=60))
    futures = [publisher.publish(topic, b"x") for _ in range(10)]
    publisher.shutdown()
    assert all(future.done() and future.result() for future in futures)
    with pytest.raises(RuntimeError):
        publisher.publish(topic, b"after shutdown")
    publisher.shutdown()  # a second call is harmless


def test_shutdown_timeout_fails_the_rest_and_cancels_their_attempts(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:120s"))
    publisher = PublisherClient()
    futures = [publisher.publish(topic, b"x") for _ in range(10)]
    wait_for(lambda: server.faults.counts["Publish"].delayed == 1)
    started = time.monotonic()
    publisher.shutdown(timeout=0.2)
    # Bounded by its timeout, not by the attempts' 120 s (30 s: room for a busy machine).
    assert time.monotonic() - started < 30
    for future in futures:
        assert isinstance(future.exception(timeout=0), ShutdownTimeoutError)
    wait_for(lambda: server.faults.counts["Publish"].cancelled_during_delay == 1)
    assert server.messages(topic) == []
    assert publisher.stats().messages_failed == 10


def test_explicit_endpoint_wins_over_the_environment(server: LocalServer, topic: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")  # nothing listens there
    with PublisherClient(endpoint=server.address) as publisher:
        assert publisher.publish(topic, b"x").result(timeout=10)


def test_emulator_host_from_the_environment(server: LocalServer, topic: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    with PublisherClient() as publisher:
        assert publisher.publish(topic, b"x").result(timeout=10)


def test_async_client_against_the_server(server: LocalServer, topic: str) -> None:
    async def scenario() -> tuple[list[str], AsyncPublisherClient]:
        async with AsyncPublisherClient(batch_settings=BatchSettings(max_messages=10)) as publisher:
            ids = await asyncio.gather(*(publisher.publish(topic, b"%d" % i, n=str(i)) for i in range(30)))
            with pytest.raises(RpcError) as caught:
                await publisher.publish(topic + "-missing", b"x")
            assert caught.value.code is StatusCode.NOT_FOUND
        return list(ids), publisher

    ids, publisher = asyncio.run(scenario())
    stored = server.messages(topic)
    # Batches travel concurrently, so the store's order across batches is not the publish order.
    assert {m.message_id: m.attributes["n"] for m in stored} == {ids[i]: str(i) for i in range(30)}
    assert publisher.stats().batches_sent == 4


def test_async_flow_control_block_awaits(server: LocalServer, topic: str) -> None:
    server.faults.set("Publish", FaultRule(latency="100%:100ms"))
    flow = FlowControlSettings(message_limit=3, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)

    async def scenario() -> list[str]:
        async with AsyncPublisherClient(flow_control=flow) as publisher:
            return list(await asyncio.gather(*(publisher.publish(topic, b"x") for _ in range(9))))

    started = time.monotonic()
    assert len(set(asyncio.run(scenario()))) == 9
    assert time.monotonic() - started >= 0.3  # three rounds of three


def test_stats_percentiles(server: LocalServer, topic: str) -> None:
    with PublisherClient(batch_settings=BatchSettings(max_messages=1)) as publisher:
        for future in [publisher.publish(topic, b"x") for _ in range(20)]:
            future.result(timeout=10)
    stats = publisher.stats()
    assert stats.batches_sent == stats.attempts_sent == 20
    assert 0 < stats.p50_ms <= stats.p90_ms <= stats.p99_ms <= stats.p999_ms <= stats.max_ms
    assert stats.tokens_available == 0.0
