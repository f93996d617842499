"""Wire sizes, batch futures, and the guarantee that no library error leaves a future pending."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hedgepub import AsyncPublisherClient, BatchSettings, PublisherClient, PublishError, ResponseMismatchError
from hedgepub._publisher.batch import request_overhead
from hedgepub._publisher.futures import BatchCondition, BatchFuture, resolve_batch
from hedgepub._publisher.observer import BatchObservers
from hedgepub._transport.grpc import PublishRequestPb, PubsubMessagePb
from hedgepub.testing.scripted import ScriptedCall, ScriptedTransport

TOPIC = "projects/test-project/topics/topic"

_text = st.text(max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=20_000),
    ordering_key=_text,
    attributes=st.dictionaries(
        st.text(min_size=1, max_size=20).filter(lambda key: key[:4].lower() != "goog"), _text, max_size=4
    ),
)
def test_computed_sizes_match_the_wire(data: bytes, ordering_key: str, attributes: dict[str, str]) -> None:
    assume(data or attributes)  # an empty message is refused (test_publish_many)
    publisher = AsyncPublisherClient(transport=ScriptedTransport(), enable_message_ordering=True)
    message, size, framed = publisher._core.prepare(TOPIC, data, ordering_key, dict(attributes))
    expected = PubsubMessagePb(data=data, attributes=attributes, ordering_key=ordering_key)
    assert size == expected.ByteSize()
    request = PublishRequestPb(topic=TOPIC, messages=[expected, expected])
    assert request.ByteSize() == request_overhead(TOPIC) + 2 * framed
    if message is not None:
        assert message == expected


@pytest.mark.parametrize("shared_condition", [True, False], ids=["batch-futures", "plain-futures"])
def test_batch_futures_behave_as_concurrent_futures(shared_condition: bool) -> None:
    condition = BatchCondition() if shared_condition else None

    def new_future() -> concurrent.futures.Future[str]:
        return BatchFuture(condition) if condition is not None else concurrent.futures.Future()

    futures = [new_future() for _ in range(4)]
    assert futures[3].cancel()
    seen: list[str] = []
    futures[0].add_done_callback(lambda future: seen.append(future.result()))
    waiter = threading.Thread(target=lambda: seen.append(futures[2].result(timeout=5)))
    waiter.start()
    with pytest.raises(concurrent.futures.TimeoutError):
        futures[1].result(timeout=0.01)
    resolve_batch(futures, condition, message_ids=["a", "b", "c", "d"])
    waiter.join()
    assert sorted(seen) == ["a", "c"]
    assert [f.result() for f in futures[:3]] == ["a", "b", "c"]
    assert futures[3].cancelled()
    _done, pending = concurrent.futures.wait(futures[:3], timeout=0)
    assert not pending

    failing = [new_future() for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        first_failure = executor.submit(concurrent.futures.wait, failing, 5, FIRST_EXCEPTION)
        resolve_batch(failing, condition, error=PublishError("boom"))
        assert not first_failure.result(timeout=5).not_done
    assert all(isinstance(f.exception(), PublishError) for f in failing)


def test_batch_futures_wake_waiters_registered_before_and_after_resolution() -> None:
    condition = BatchCondition()
    futures = [BatchFuture(condition) for _ in range(6)]
    completed: list[str] = []
    # A waiter on a future in the middle of the batch, another on two of its futures, before resolution.
    waiting = threading.Thread(target=lambda: completed.append(futures[2].result(timeout=5)))
    waiting.start()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        in_order = executor.submit(
            lambda: [f.result() for f in concurrent.futures.as_completed(futures[3:5], 5)]
        )
        while not futures[3].__dict__.get("_waiters"):  # as_completed has installed its waiter
            threading.Event().wait(0.001)
        callbacks: list[str] = []
        futures[5].add_done_callback(lambda future: callbacks.append(future.result()))
        assert futures[1].cancel()
        resolve_batch(futures, condition, message_ids=[str(n) for n in range(6)])
        waiting.join(5)
        assert sorted(in_order.result(timeout=5)) == ["3", "4"]
    assert completed == ["2"] and callbacks == ["5"]
    assert futures[1].cancelled() and [f.result() for f in futures if not f.cancelled()] == [
        "0",
        "2",
        "3",
        "4",
        "5",
    ]
    late: list[str] = []
    futures[0].add_done_callback(lambda future: late.append(future.result()))  # done: runs at once
    assert late == ["0"]


def test_done_callbacks_run_once_each_in_order_and_a_raising_one_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    condition = BatchCondition()
    futures = [BatchFuture(condition) for _ in range(5)]
    calls: list[tuple[int, str | None]] = []

    def note(index: int) -> object:
        return lambda future: calls.append((index, None if future.cancelled() else future.result()))

    futures[2].add_done_callback(note(2))
    futures[0].add_done_callback(note(0))
    futures[0].add_done_callback(note(10))  # two on one future: both, in order
    futures[3].add_done_callback(lambda future: 1 / 0)  # logged, the others still run
    futures[3].add_done_callback(note(3))
    futures[4].add_done_callback(note(4))
    assert futures[4].cancel()  # its callback runs now, once, and not again when the batch resolves
    assert calls == [(4, None)]
    assert futures[4].cancel()  # cancelled already: nothing runs again
    with caplog.at_level("ERROR", logger="concurrent.futures"):
        resolve_batch(futures, condition, message_ids=["a", "b", "c", "d", "e"])
    assert calls == [(4, None), (2, "c"), (0, "a"), (10, "a"), (3, "d")]
    assert "exception calling callback" in caplog.text
    assert condition.callbacks == []
    futures[1].add_done_callback(note(1))  # done: runs at once, in this thread
    assert calls[-1] == (1, "b")


def test_done_callbacks_from_many_threads_each_run_once() -> None:
    condition = BatchCondition()
    futures = [BatchFuture(condition) for _ in range(2_000)]
    counts = [0] * len(futures)
    lock = threading.Lock()

    def count(index: int) -> object:
        def callback(future: object) -> None:
            with lock:
                counts[index] += 1

        return callback

    def add(start: int) -> None:
        for index in range(start, len(futures), 4):
            futures[index].add_done_callback(count(index))

    adders = [threading.Thread(target=add, args=(start,)) for start in range(4)]
    for adder in adders[:2]:
        adder.start()
    resolver = threading.Thread(
        target=resolve_batch, args=(futures, condition, [str(n) for n in range(2_000)])
    )
    resolver.start()
    for adder in adders[2:]:
        adder.start()
    for thread in [*adders, resolver]:
        thread.join()
    assert counts == [1] * len(futures)  # whether added before, during or after the resolution


@pytest.mark.parametrize(
    "length", [1, 125, 126, 127, 128, 129, 16_365, 16_366, 16_367, 16_368, 16_383, 16_384, 70_000]
)
def test_plain_messages_are_sized_as_on_the_wire(length: int) -> None:
    # (An empty message, of no data and no attributes, is refused at the call: test_publish_many.)
    # Payloads around the lengths where the message's and the framed message's length prefixes grow,
    # published without attributes (the sync client's fast path below 16 KiB) between messages with
    # attributes: the batch's byte count is the request's, and the order is kept.
    transport = ScriptedTransport()
    settings_ = BatchSettings(max_messages=1000, max_latency=60)
    with PublisherClient(transport=transport, batch_settings=settings_) as publisher:
        payloads = [bytes([n]) * length for n in range(3)]
        futures = [publisher.publish(TOPIC, payloads[0]), publisher.publish(TOPIC, payloads[1])]
        futures.append(publisher.publish(TOPIC, payloads[2], kind="attributed"))
        futures.append(publisher.publish(TOPIC, payloads[0]))
        (batch,) = publisher._core._open.values()
        assert batch.byte_size == batch.request.ByteSize() == len(batch.wire())
        # The bytes framed by hand are those protobuf would write for the same messages.
        messages = [PubsubMessagePb(data=payload) for payload in (payloads[0], payloads[1])]
        messages += [PubsubMessagePb(data=payloads[2], attributes={"kind": "attributed"})]
        messages += [PubsubMessagePb(data=payloads[0])]
        assert batch.wire() == PublishRequestPb(topic=TOPIC, messages=messages).SerializeToString()
    assert [f.result() for f in futures] == ["0", "1", "2", "3"]
    (call,) = transport.calls
    assert [m.data for m in call.request.messages] == [payloads[0], payloads[1], payloads[2], payloads[0]]


def test_plain_messages_of_mixed_lengths_keep_their_order_on_the_wire() -> None:
    # Messages of data alone are framed when the request is built: runs of one length and of several,
    # before and after a message with attributes, come out as protobuf would write them, in order.
    transport = ScriptedTransport()
    settings_ = BatchSettings(max_messages=1000, max_latency=60)
    before = [b"z", b"a", b"b" * 200, b"c" * 16_366, b"d" * 20_000, b"e"]
    after = [b"f" * 3, b"g" * 3, b"h" * 3]
    with PublisherClient(transport=transport, batch_settings=settings_) as publisher:
        futures = [publisher.publish(TOPIC, payload) for payload in before]
        futures.append(publisher.publish(TOPIC, b"attributed", kind="x"))
        futures += [publisher.publish(TOPIC, payload) for payload in after]
        (batch,) = publisher._core._open.values()
        messages = [PubsubMessagePb(data=payload) for payload in before]
        messages.append(PubsubMessagePb(data=b"attributed", attributes={"kind": "x"}))
        messages += [PubsubMessagePb(data=payload) for payload in after]
        expected = PublishRequestPb(topic=TOPIC, messages=messages).SerializeToString()
        assert batch.wire() == expected  # while open: built, not kept
        assert batch.byte_size == len(expected)
    assert [future.result() for future in futures] == [str(n) for n in range(len(messages))]
    (call,) = transport.calls
    assert call.request.SerializeToString() == expected


def test_a_transport_that_breaks_fails_the_futures() -> None:
    async def broken(call: ScriptedCall) -> Sequence[str]:
        raise ValueError("transport bug")

    async def too_few(call: ScriptedCall) -> Sequence[str]:
        return ["only-one"]

    transport = ScriptedTransport([broken, too_few])
    with PublisherClient(transport=transport) as publisher:
        with pytest.raises(PublishError) as caught:
            publisher.publish(TOPIC, b"x").result(timeout=5)
        assert isinstance(caught.value.__cause__, ValueError)
        futures = [publisher.publish(TOPIC, b"y") for _ in range(3)]
        for future in futures:
            assert isinstance(future.exception(timeout=5), ResponseMismatchError)
    assert publisher.stats().messages_failed == 4


def test_sync_client_validation_errors() -> None:
    with PublisherClient(transport=ScriptedTransport()) as publisher:
        with pytest.raises(TypeError, match="bytes"):
            publisher.publish(TOPIC, "text")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="attribute"):
            publisher.publish(TOPIC, b"x", number=1)
        with pytest.raises(TypeError, match="attribute"):
            publisher.publish(TOPIC, b"x", raw=b"\xff")
        with pytest.raises(ValueError, match="enable_message_ordering"):
            publisher.publish(TOPIC, b"x", ordering_key="k")
        with pytest.raises(ValueError, match="cannot fit"):
            publisher.publish(TOPIC, bytes(10_000_000))
        assert publisher.publish(TOPIC, b"fine", text="ok").result(timeout=5) == "0"
    assert PublisherClient.topic_path("proj", "top") == "projects/proj/topics/top"
    assert AsyncPublisherClient.topic_path("proj", "top") == "projects/proj/topics/top"


def test_observers_are_all_told_even_when_one_raises() -> None:
    seen: list[str] = []

    class Recording:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def batch_finished(self, batch: object, outcome: object, error: BaseException | None) -> None:
            seen.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} broke")

    observers = BatchObservers([Recording("stats", fails=True), Recording("routes"), Recording("telemetry")])
    with pytest.raises(RuntimeError, match="stats broke"):
        observers.batch_finished(object(), None, None)  # type: ignore[arg-type]
    assert seen == ["stats", "routes", "telemetry"]
