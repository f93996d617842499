"""The asyncio publisher against a scripted transport, on virtual time: exact batching and hedging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    FlowControlLimitError,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    OrderingKeyPausedError,
    PublishTimeoutError,
    RetrySettings,
    RpcError,
    ShutdownTimeoutError,
    StatusCode,
)
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry, encode_client_telemetry
from hedgepub.testing.scripted import ScriptedCall, ScriptedTransport
from hedgepub.testing.virtual_time import virtual_time

TOPIC = "projects/test-project/topics/topic"


def now() -> float:
    return asyncio.get_running_loop().time()


def client(transport: ScriptedTransport, **settings: object) -> AsyncPublisherClient:
    return AsyncPublisherClient(transport=transport, **settings)  # type: ignore[arg-type]


async def publish_many(publisher: AsyncPublisherClient, count: int, **kwargs: object) -> list[str]:
    return list(await asyncio.gather(*(publisher.publish(TOPIC, b"m%d" % i, **kwargs) for i in range(count))))


@virtual_time
async def test_batch_sent_when_max_messages_reached() -> None:
    transport = ScriptedTransport()
    async with client(transport, batch_settings=BatchSettings(max_messages=3, max_latency=10)) as publisher:
        ids = await publish_many(publisher, 7)
    assert ids == [str(i) for i in range(7)]
    assert [len(call.request.messages) for call in transport.calls] == [3, 3, 1]
    assert publisher.stats().batches_sent == 3 and publisher.stats().messages_published == 7


@virtual_time
async def test_batch_sent_after_max_latency() -> None:
    transport = ScriptedTransport()
    publisher = client(transport, batch_settings=BatchSettings(max_messages=100, max_latency=0.25))
    assert await publish_many(publisher, 2) == ["0", "1"]
    assert now() == 0.25
    assert len(transport.calls) == 1
    await publisher.shutdown()
    assert transport.closed


@virtual_time
async def test_batch_sent_before_max_bytes_is_passed() -> None:
    transport = ScriptedTransport()
    # Topic field: 2 + len(TOPIC) bytes; each 100-byte message: 2 + (2 + 100) bytes on the wire.
    overhead, framed = 2 + len(TOPIC), 104
    settings = BatchSettings(max_messages=1000, max_bytes=overhead + 3 * framed, max_latency=10)
    async with client(transport, batch_settings=settings) as publisher:
        await asyncio.gather(*(publisher.publish(TOPIC, b"x" * 100) for _ in range(7)))
    assert [len(call.request.messages) for call in transport.calls] == [3, 3, 1]
    assert all(call.request.ByteSize() <= settings.max_bytes for call in transport.calls)


@virtual_time
async def test_attributes_and_metadata_reach_the_request() -> None:
    transport = ScriptedTransport()
    async with client(transport) as publisher:
        await publisher.publish(TOPIC, b"data", origin="test", kind=b"bytes are decoded")
    call = transport.calls[0]
    assert dict(call.request.messages[0].attributes) == {"origin": "test", "kind": "bytes are decoded"}
    assert call.request.topic == TOPIC
    assert call.metadata["x-goog-request-params"] == f"topic={TOPIC}"
    assert decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0] == 0  # hedging off: sent too
    assert call.metadata["hedgepub-batch-id"]


@virtual_time
async def test_retries_unavailable_with_back_off() -> None:
    transport = ScriptedTransport([ScriptedTransport().fail(StatusCode.UNAVAILABLE)] * 2)
    async with client(transport) as publisher:
        assert await publisher.publish(TOPIC, b"x") == "0"
    # Default retry settings: 0.1 s, then 0.4 s of back-off (plus the 10 ms batch latency).
    assert [call.outcome for call in transport.calls] == ["error", "error", "ok"]
    assert now() == pytest.approx(0.51)
    assert publisher.stats().attempts_sent == 3


@virtual_time
async def test_permanent_error_fails_at_once() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().fail(StatusCode.NOT_FOUND))
    async with client(transport) as publisher:
        with pytest.raises(RpcError) as caught:
            await publisher.publish(TOPIC, b"x")
    assert caught.value.code is StatusCode.NOT_FOUND
    assert len(transport.calls) == 1
    assert publisher.stats().messages_failed == 1


@virtual_time
async def test_total_timeout_fails_with_last_error() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().fail(StatusCode.UNAVAILABLE))
    retry = RetrySettings(initial_rpc_timeout=1, total_timeout=2)
    async with client(transport, retry_settings=retry) as publisher:
        with pytest.raises(PublishTimeoutError) as caught:
            await publisher.publish(TOPIC, b"x")
    assert isinstance(caught.value.last_error, RpcError)


async def hedging_publisher(
    *, hedge_delay: float, max_tokens: int, refill_ratio: float
) -> tuple[ScriptedTransport, AsyncPublisherClient]:
    """A hedging publisher on a scripted transport, its bucket filled to ``max_tokens`` by quick batches."""
    transport = ScriptedTransport()
    hedging = HedgingSettings(hedge_delay=hedge_delay, max_tokens=max_tokens, refill_ratio=refill_ratio)
    publisher = client(transport, hedging_settings=hedging)
    for _ in range(round(max_tokens / refill_ratio)):
        await publisher.publish(TOPIC, b"warm-up")
    assert publisher.stats().tokens_available == max_tokens
    return transport, publisher


@virtual_time
async def test_hedge_wins_and_the_original_is_cancelled() -> None:
    transport, publisher = await hedging_publisher(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    transport.script.extend([transport.ok(delay=5.0), transport.ok(delay=0.02)])
    started = now()
    assert await publisher.publish(TOPIC, b"slow") == "5"  # IDs of the hedge, the first to answer
    assert now() - started == pytest.approx(0.01 + 0.1 + 0.02)
    original, hedge = transport.calls[-2:]
    assert [
        decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0] for call in (original, hedge)
    ] == [0, 1]
    assert original.metadata["hedgepub-batch-id"] == hedge.metadata["hedgepub-batch-id"]
    await asyncio.sleep(0.001)  # the cancellation travels down the attempt's layers
    assert original.outcome == "cancelled"
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_won, stats.attempts_sent) == (1, 1, 7)
    await publisher.shutdown()


@virtual_time
async def test_no_hedge_when_the_bucket_is_empty() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=0.5))
    publisher = client(transport, hedging_settings=HedgingSettings(hedge_delay=0.1))
    await publisher.publish(TOPIC, b"x")
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_skipped, len(transport.calls)) == (0, 1, 1)
    await publisher.shutdown()


@virtual_time
async def test_hedging_stops_by_itself_under_sustained_slowness() -> None:
    transport, publisher = await hedging_publisher(hedge_delay=0.1, max_tokens=2, refill_ratio=0.1)
    transport.default = transport.ok(delay=0.35)  # every attempt is slow now, hedges too
    for _ in range(10):
        await publisher.publish(TOPIC, b"slow")
    stats = publisher.stats()
    # Two tokens pay for the first slow batch's two hedges; every later hedge point finds less than a
    # token (ten successes refill only one, by the end), so hedging stays off.
    assert stats.hedges_sent == 2
    assert stats.hedges_skipped == 10
    assert stats.tokens_available == 1.0
    await publisher.shutdown()


@virtual_time
async def test_ordering_key_one_batch_at_a_time_and_paused_after_failure() -> None:
    transport = ScriptedTransport()
    settings = BatchSettings(max_messages=2, max_latency=0.01)
    publisher = client(transport, batch_settings=settings, enable_message_ordering=True)
    transport.script.extend([transport.ok(delay=1.0), transport.ok(delay=0.1)])
    first = await asyncio.gather(*(publisher.publish(TOPIC, b"%d" % i, ordering_key="k") for i in range(4)))
    assert first == ["0", "1", "2", "3"]
    # The second batch waited for the first: it was sent only after one second.
    assert now() == pytest.approx(1.1)
    assert [[m.data for m in call.request.messages] for call in transport.calls] == [
        [b"0", b"1"],
        [b"2", b"3"],
    ]

    transport.script.append(transport.fail(StatusCode.INVALID_ARGUMENT, delay=0.5))
    results = await asyncio.gather(
        *(publisher.publish(TOPIC, b"x", ordering_key="k") for _ in range(3)), return_exceptions=True
    )
    assert isinstance(results[0], RpcError) and isinstance(results[1], RpcError)
    assert isinstance(results[2], OrderingKeyPausedError)
    with pytest.raises(OrderingKeyPausedError):
        await publisher.publish(TOPIC, b"later", ordering_key="k")
    assert await publisher.publish(TOPIC, b"other key", ordering_key="j") is not None
    publisher.resume_publish(TOPIC, "k")
    assert await publisher.publish(TOPIC, b"resumed", ordering_key="k") is not None
    await publisher.shutdown()


@virtual_time
async def test_flow_control_error() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=1.0))
    flow = FlowControlSettings(message_limit=2, limit_exceeded_behavior=LimitExceededBehavior.ERROR)
    publisher = client(transport, flow_control=flow)
    tasks = [asyncio.ensure_future(publisher.publish(TOPIC, b"x")) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(FlowControlLimitError):
        await publisher.publish(TOPIC, b"too many")
    await asyncio.gather(*tasks)
    assert await publisher.publish(TOPIC, b"room again") == "2"
    await publisher.shutdown()


@virtual_time
async def test_flow_control_block_waits_in_order() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=1.0))
    flow = FlowControlSettings(message_limit=2, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    publisher = client(transport, flow_control=flow, batch_settings=BatchSettings(max_latency=5))
    results = await asyncio.gather(*(publisher.publish(TOPIC, b"%d" % i) for i in range(5)))
    assert results == ["0", "1", "2", "3", "4"]
    # While someone waits, the open batch is flushed at once instead of after its 5 s: messages 0-1
    # go at 0 s, 2-3 at 1 s; message 4, admitted at 2 s with nobody left waiting, keeps its batch latency.
    assert [call.request.messages[0].data for call in transport.calls] == [b"0", b"2", b"4"]
    assert now() == pytest.approx(2.0 + 5.0 + 1.0)
    assert [len(call.request.messages) for call in transport.calls] == [2, 2, 1]
    await publisher.shutdown()


@virtual_time
async def test_shutdown_flushes_everything() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=2.0))
    publisher = client(transport, batch_settings=BatchSettings(max_latency=60))
    tasks = [asyncio.ensure_future(publisher.publish(TOPIC, b"x")) for _ in range(3)]
    await asyncio.sleep(0)
    await publisher.shutdown()
    assert now() == 2.0
    assert [task.result() for task in tasks] == ["0", "1", "2"]
    with pytest.raises(RuntimeError):
        await publisher.publish(TOPIC, b"after")


@virtual_time
async def test_shutdown_timeout_fails_leftovers_and_cancels_their_attempts() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=100.0))
    ordered = client(transport, enable_message_ordering=True, batch_settings=BatchSettings(max_messages=1))
    tasks = [asyncio.ensure_future(ordered.publish(TOPIC, b"x", ordering_key="k")) for _ in range(3)]
    await asyncio.sleep(0)
    await ordered.shutdown(timeout=1.0)
    assert now() == 1.0
    for task in tasks:
        assert isinstance(task.exception(), ShutdownTimeoutError)
    assert [call.outcome for call in transport.calls] == ["cancelled"]
    assert ordered.stats().messages_failed == 3


@virtual_time
async def test_validation_errors() -> None:
    publisher = client(ScriptedTransport())
    with pytest.raises(TypeError):
        await publisher.publish(TOPIC, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await publisher.publish(TOPIC, b"x", count=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enable_message_ordering"):
        await publisher.publish(TOPIC, b"x", ordering_key="k")
    with pytest.raises(ValueError, match="cannot fit"):
        await publisher.publish(TOPIC, b"x" * 10_000_000)
    await publisher.shutdown()


@virtual_time
async def test_a_keyed_batch_is_never_hedged_and_leaves_the_bucket_alone() -> None:
    # Rule 23: one publisher hedges its unkeyed batches and never those with an ordering key.
    transport = ScriptedTransport()
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    publisher = client(transport, hedging_settings=hedging, enable_message_ordering=True)
    for _ in range(5):
        await publisher.publish(TOPIC, b"warm-up")
    assert publisher.stats().tokens_available == 1
    transport.script.append(transport.ok(delay=3.0))
    started = now()
    assert await publisher.publish(TOPIC, b"keyed", ordering_key="k") == "5"
    assert now() - started == pytest.approx(0.01 + 3.0)  # the original alone, answered after 3 s
    stats = publisher.stats()
    assert (stats.attempts_sent, stats.hedges_sent, stats.hedges_skipped) == (6, 0, 0)
    assert (stats.unhedged_keyed_batches, stats.tokens_available) == (1, 1)  # not spent, not refilled
    transport.script.extend([transport.ok(delay=3.0), transport.ok(delay=0.02)])
    assert await publisher.publish(TOPIC, b"unkeyed") == "6"
    original, hedge = transport.calls[-2:]
    assert [
        decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0] for call in (original, hedge)
    ] == [0, 1]
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_won, stats.unhedged_keyed_batches) == (1, 1, 1)
    assert stats.tokens_available == pytest.approx(0.2)  # spent one, refilled once
    await publisher.shutdown()


def test_construction_refuses_hedging_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="initial_rpc_timeout"):
        AsyncPublisherClient(
            hedging_settings=HedgingSettings(hedge_delay=2),
            retry_settings=RetrySettings(initial_rpc_timeout=1),
        )


@virtual_time
async def test_retries_and_hedges_of_a_batch_share_its_metadata() -> None:
    transport, publisher = await hedging_publisher(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    # Original: UNAVAILABLE at 0.02 s, retried at 0.12 s; hedge 1 at 0.1 s is slow; the retry wins.
    unavailable = transport.fail(StatusCode.UNAVAILABLE, delay=0.02)
    transport.script.extend([unavailable, transport.ok(delay=5.0), transport.ok(delay=0.01)])
    assert await publisher.publish(TOPIC, b"x") == "5"
    original, hedge, retry = transport.calls[-3:]
    telemetry = [
        decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY]) for call in (original, hedge, retry)
    ]
    assert [count for count, _start in telemetry] == [0, 1, 0]
    assert len({start for _count, start in telemetry}) == 1  # the batch's start time, on every attempt
    start = telemetry[0][1]
    assert start is not None and abs(start - time.time()) < 60  # wall-clock seconds, not the loop's
    # Byte for byte what Google's clients send: (0, start) on the original and its retry, (1, start) on
    # the hedge; no -bin key, standard base64.
    assert [call.metadata[CLIENT_TELEMETRY_KEY] for call in (original, hedge, retry)] == [
        encode_client_telemetry(0, start),
        encode_client_telemetry(1, start),
        encode_client_telemetry(0, start),
    ]
    assert {call.metadata["hedgepub-batch-id"] for call in (original, hedge, retry)} == {
        original.metadata["hedgepub-batch-id"]
    }
    assert all(call.metadata["x-goog-request-params"] == f"topic={TOPIC}" for call in transport.calls)
    assert len({call.metadata["hedgepub-batch-id"] for call in transport.calls}) == 6  # one per batch
    await asyncio.sleep(0.001)
    assert (original.outcome, hedge.outcome, retry.outcome) == ("error", "cancelled", "ok")
    stats = publisher.stats()
    assert (stats.attempts_sent, stats.hedges_sent, stats.hedges_won) == (5 + 3, 1, 0)
    await publisher.shutdown()


@virtual_time
async def test_shutdown_timeout_counts_the_attempts_of_the_batches_it_cuts_off() -> None:
    transport, publisher = await hedging_publisher(hedge_delay=1.0, max_tokens=2, refill_ratio=0.2)
    transport.default = transport.ok(delay=100.0)
    task = asyncio.ensure_future(publisher.publish(TOPIC, b"stuck"))
    await asyncio.sleep(0)
    await publisher.shutdown(timeout=2.5)  # the original, then hedges at 1 s and 2 s, all unanswered
    assert isinstance(task.exception(), ShutdownTimeoutError)
    assert [call.outcome for call in transport.calls[10:]] == ["cancelled"] * 3
    stats = publisher.stats()
    assert (stats.messages_published, stats.messages_failed) == (10, 1)
    assert (stats.batches_sent, stats.attempts_sent, stats.hedges_sent, stats.hedges_won) == (11, 13, 2, 0)
    assert stats.max_ms == pytest.approx(2500, rel=0.001)  # shutdown sent the batch at once, cut it at 2.5 s


@virtual_time
async def test_one_topic_draining_its_tokens_on_stalls_leaves_another_topics_hedges_firing() -> None:
    # docs/hedging.md rule 13: a bucket per topic, each with the settings' size, each starting empty.
    stalling, healthy = f"{TOPIC}-stalling", f"{TOPIC}-healthy"
    transport = ScriptedTransport()
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=2, refill_ratio=0.2)
    publisher = client(transport, hedging_settings=hedging)
    assert publisher.stats().tokens_by_topic == {}
    for topic in (stalling, healthy):
        for _ in range(10):  # 10 quick batches: 2 tokens, this topic's bucket full
            await publisher.publish(topic, b"warm-up")
    assert dict(publisher.stats().tokens_by_topic) == {stalling: 2.0, healthy: 2.0}
    assert publisher.stats().tokens_available == 4.0  # every topic's tokens together

    async def answer(call: ScriptedCall) -> Sequence[str]:
        # The stalling topic answers after 1 s, every attempt; the healthy one's hedges at once.
        hedge = decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0] > 0
        await asyncio.sleep(1.0 if call.request.topic == stalling or not hedge else 0.01)
        return transport.next_ids(len(call.request.messages))

    transport.default = answer
    before = publisher.stats()
    for _ in range(3):
        await publisher.publish(stalling, b"stalled")
    stats = publisher.stats()
    # The first stall's hedges 1 and 2 spend the topic's two tokens; from then on every hedge point finds
    # less than one (0.2 back per success): one skip per batch.
    assert (stats.hedges_sent - before.hedges_sent, stats.hedges_skipped - before.hedges_skipped) == (2, 3)
    assert stats.tokens_by_topic[stalling] == pytest.approx(0.6)
    assert stats.tokens_by_topic[healthy] == 2.0  # untouched
    started = now()
    await publisher.publish(healthy, b"slow original")
    assert now() - started == pytest.approx(0.01 + 0.1 + 0.01)  # its hedge fired and won
    assert publisher.stats().hedges_won >= 1
    await publisher.shutdown()
