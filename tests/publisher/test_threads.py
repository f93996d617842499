"""Many threads sharing one PublisherClient: per-thread batches, no lost or pending future, cheap futures."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter

from hedgepub import BatchSettings, PublisherClient
from hedgepub._publisher.futures import BatchCondition, BatchFuture, resolve_batch
from hedgepub.testing.scripted import ScriptedTransport

TOPIC = "projects/test-project/topics/topic"
OTHER = "projects/test-project/topics/other"


def _publish_from_threads(
    publisher: PublisherClient, threads: int, per_thread: int, **kwargs: str
) -> list[list[concurrent.futures.Future[str]]]:
    start = threading.Barrier(threads)
    futures: list[list[concurrent.futures.Future[str]]] = [[] for _ in range(threads)]

    def work(index: int) -> None:
        start.wait()
        for number in range(per_thread):
            topic = TOPIC if number % 3 else OTHER
            futures[index].append(publisher.publish(topic, b"t%d-%d" % (index, number), **kwargs))

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return futures


def test_eight_threads_every_message_sent_once_and_every_future_resolved() -> None:
    transport = ScriptedTransport()
    settings = BatchSettings(max_messages=7, max_latency=0.005)
    with PublisherClient(transport=transport, batch_settings=settings) as publisher:
        futures = _publish_from_threads(publisher, threads=8, per_thread=500)
        ids = [future.result(timeout=10) for share in futures for future in share]
    assert len(ids) == len(set(ids)) == 4000
    sent = Counter(message.data for call in transport.calls for message in call.request.messages)
    assert len(sent) == 4000 and set(sent.values()) == {1}
    assert all(len(call.request.messages) <= 7 for call in transport.calls)
    # Each request holds one thread's messages for one topic, in the order that thread published them.
    for call in transport.calls:
        data = [message.data for message in call.request.messages]
        assert len({item.split(b"-")[0] for item in data}) == 1
        assert data == sorted(data, key=lambda item: int(item.split(b"-")[1]))
    assert publisher.stats().messages_published == 4000


def test_shutdown_while_threads_publish_leaves_no_future_pending() -> None:
    transport = ScriptedTransport()
    publisher = PublisherClient(transport=transport, batch_settings=BatchSettings(max_latency=10))
    accepted: list[concurrent.futures.Future[str]] = []
    refused = Counter[str]()
    go = threading.Event()

    def work(index: int) -> None:
        go.wait()
        for number in range(2000):
            try:
                accepted.append(publisher.publish(TOPIC, b"%d-%d" % (index, number)))
            except RuntimeError:
                refused[str(index)] += 1
                return

    workers = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for worker in workers:
        worker.start()
    go.set()
    publisher.shutdown()
    for worker in workers:
        worker.join()
    # Whatever publish accepted was flushed by shutdown (max_latency is 10 s): nothing waits for a timer.
    assert all(future.done() for future in accepted)
    assert sorted(future.result() for future in accepted) == sorted(str(n) for n in range(len(accepted)))
    assert publisher.stats().messages_published == len(accepted)


def _race_shutdown_against_threads(head_start: float) -> None:
    transport = ScriptedTransport()
    settings = BatchSettings(max_messages=3, max_latency=10)
    publisher = PublisherClient(transport=transport, batch_settings=settings)
    accepted: list[concurrent.futures.Future[str]] = []
    start = threading.Barrier(9)

    def work(index: int) -> None:
        start.wait()
        for number in range(3_000):
            try:
                accepted.append(publisher.publish(TOPIC, b"%d-%d" % (index, number)))
            except RuntimeError:
                return

    workers = [threading.Thread(target=work, args=(index,)) for index in range(8)]
    for worker in workers:
        worker.start()
    start.wait()
    threading.Event().wait(head_start)
    publisher.shutdown()
    pending = [future for future in accepted if not future.done()]
    for worker in workers:
        worker.join()
    assert pending == [], f"{len(pending)} of {len(accepted)} futures left pending"
    failed = Counter(repr(future.exception(timeout=0)) for future in accepted if future.exception(timeout=0))
    assert not failed, f"accepted messages failed: {dict(failed)}"
    sent = Counter(message.data for call in transport.calls for message in call.request.messages)
    twice = [data for data, times in sent.items() if times > 1]
    assert (len(sent), twice) == (len(accepted), []), f"{len(sent)} sent, {len(accepted)} accepted"


def test_shutdown_racing_threads_that_open_batches_all_the_time_leaves_no_future_pending() -> None:
    # Three messages per batch: the threads open (and seal) their own batches without the publisher's
    # lock every third message, so shutdown meets them mid-open again and again.
    for attempt in range(10):
        _race_shutdown_against_threads(head_start=0.001 * (attempt % 5))


def test_ordered_messages_share_one_batch_per_key_across_threads() -> None:
    transport = ScriptedTransport()
    settings = BatchSettings(max_messages=1000, max_latency=0.05)
    with PublisherClient(
        transport=transport, batch_settings=settings, enable_message_ordering=True
    ) as publisher:
        futures = _publish_from_threads(publisher, threads=4, per_thread=50, ordering_key="key")
        for share in futures:
            for future in share:
                future.result(timeout=10)
    # One batch per topic and key, whatever thread published: a later message never overtakes.
    assert sorted(call.request.topic for call in transport.calls) == [OTHER, TOPIC]


def test_a_fresh_batch_future_holds_no_lists_until_used() -> None:
    condition = BatchCondition()
    quiet, watched = BatchFuture(condition), BatchFuture(condition)
    assert vars(quiet) == {"_condition": condition, "_state": "PENDING", "_result": None, "_exception": None}
    assert not quiet.done() and not quiet.running() and "pending" in repr(quiet)
    seen: list[str] = []
    watched.add_done_callback(lambda future: seen.append(future.result()))
    resolve_batch([quiet, watched], condition, message_ids=["1", "2"])
    assert (quiet.result(timeout=0), watched.result(timeout=0), seen) == ("1", "2", ["2"])
    assert "_waiters" not in vars(quiet) and "finished" in repr(quiet)
    # A done-callback is kept in the batch's condition, not in a list of the future's own.
    assert "_done_callbacks" not in vars(watched) and list(condition.watched) == []
    assert condition.callbacks == []  # run, and let go
    late: list[str] = []
    quiet.add_done_callback(lambda future: late.append(future.result()))  # runs at once when done
    assert late == ["1"]
    assert list(concurrent.futures.as_completed([quiet, watched], timeout=0)) != []
