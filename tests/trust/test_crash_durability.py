"""No acknowledged message is lost when the server is killed with SIGKILL while publishers publish.

``hedgepub serve`` runs as a subprocess on SQLite, killed with SIGKILL at random moments (seeded) and
restarted on the same data directory and port. Two publishers, one test each:

- **Raw gRPC** (``test_kill_9_while_raw_grpc_publishes...``): several tasks send batches until the server
  goes away, and remember every message the server acknowledged (answered with IDs). Raw gRPC makes
  "acknowledged" exact: a message counts only if its Publish call returned. After each restart the
  topic and subscription are back; at the end the subscription, created before publishing, delivers
  every acknowledged message with the same ID and data.
- **The hedging client** (``test_no_acknowledged_message_is_lost_across_sigkill``): a hedging
  :class:`~hedgepub.PublisherClient` publishes continuously, each message with a unique payload and
  attributes, and records every message whose future resolved with an ID ("acknowledged"); its retries
  carry it over each restart. At the end the server is killed and restarted once more, so that
  everything is read back from disk, and the subscription must deliver every acknowledged message with
  its data and attributes intact, no ID given to two messages, no publish failed.

Settings (environment variables):

- ``HEDGEPUB_TRUST_ROUNDS``: kill-and-restart rounds of each test (default 4, about 15 s for the
  client's; the long run uses 50).
- ``HEDGEPUB_TRUST_ROUND_SECONDS``: each kill comes at a moment drawn uniformly between 0 and this
  many seconds (default 1.0) after the client has got through to the restarted server (for raw gRPC:
  between 0.2 s and 0.2 s + 0.4 times this after the publishers start).
- ``HEDGEPUB_TRUST_SEED``: seed of the kill moments (default 20261129).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from hedgepub import BatchSettings, HedgingSettings, PublisherClient, RetrySettings
from hedgepub.server._methods import RPCS

from .._pb import (
    AcknowledgeRequest,
    GetSubscriptionRequest,
    PublishRequest,
    PubsubMessage,
    PullRequest,
    PullResponse,
    Subscription,
    Topic,
)

ROUNDS = int(os.environ.get("HEDGEPUB_TRUST_ROUNDS", "") or 4)
ROUND_SECONDS = float(os.environ.get("HEDGEPUB_TRUST_ROUND_SECONDS", "") or 1.0)

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="kills the server process with SIGKILL"),
    pytest.mark.slow,
    # A round takes a few seconds (restart, reconnect, publish); the long setting needs more than the
    # project-wide 300 s.
    pytest.mark.timeout(120 + ROUNDS * (20 + ROUND_SECONDS)),
]
SEED = int(os.environ.get("HEDGEPUB_TRUST_SEED", "") or 20261129)

TOPIC = "projects/trust/topics/crash"
SUBSCRIPTION = "projects/trust/subscriptions/crash-all"
#: Most messages published but not yet resolved at once, so a kill always has a few batches in flight.
MAX_OUTSTANDING = 2000
#: Acknowledgements to wait for after each restart before the next kill may come.
PROGRESS_MESSAGES = 200


class Ledger:
    """What the publisher was told: acknowledged messages (ID -> payload, attributes) and failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acknowledged: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.failures: list[BaseException] = []
        self.duplicate_ids: list[str] = []
        self.outstanding = threading.Semaphore(MAX_OUTSTANDING)

    def watch(self, future: concurrent.futures.Future[str], data: bytes, attributes: dict[str, str]) -> None:
        """Record the outcome of ``future`` when it resolves."""

        def done(resolved: concurrent.futures.Future[str]) -> None:
            error = resolved.exception()
            with self.lock:
                if error is not None:
                    self.failures.append(error)
                else:
                    message_id = resolved.result()
                    if message_id in self.acknowledged:
                        self.duplicate_ids.append(message_id)
                    self.acknowledged[message_id] = (data, attributes)
            self.outstanding.release()

        future.add_done_callback(done)


def _message(index: int, rng: random.Random) -> tuple[bytes, dict[str, str]]:
    body = f"crash-{index:08d}-".encode() + rng.randbytes(rng.randrange(1, 200))
    attributes = {
        "index": str(index),
        "sha256": hashlib.sha256(body).hexdigest(),
        # Non-ASCII text must come back exactly too.
        "note": f"überprüft-{index % 7}",
    }
    return body, attributes


def _publish_until(
    publisher: PublisherClient, ledger: Ledger, stop: threading.Event, sent: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    index = 0
    while not stop.is_set():
        if not ledger.outstanding.acquire(timeout=0.1):
            continue
        data, attributes = _message(index, rng)
        ledger.watch(publisher.publish(TOPIC, data, **attributes), data, attributes)
        index += 1
        sent[0] = index
        if index % 50 == 0:
            # Keep publishing steady rather than as fast as the loop spins: many small batches.
            time.sleep(0.002)


def _wait_for_progress(ledger: Ledger, messages: int, timeout: float) -> float:
    """Wait until ``messages`` more messages are acknowledged; returns the seconds waited."""
    started = time.monotonic()
    with ledger.lock:
        target = len(ledger.acknowledged) + messages
    while True:
        with ledger.lock:
            if len(ledger.acknowledged) >= target:
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            pytest.fail(f"the publisher acknowledged nothing new for {timeout} s after a restart")
        time.sleep(0.01)


def _drain(rpc: Any) -> dict[str, Any]:
    """Pull (and ack) everything the subscription holds; message ID -> PubsubMessage."""
    delivered: dict[str, Any] = {}
    empty_pulls = 0
    while empty_pulls < 3:
        response = rpc.call(
            "Subscriber",
            "Pull",
            PullRequest(subscription=SUBSCRIPTION, max_messages=1000, return_immediately=True),
            PullResponse,
        )
        if not response.received_messages:
            empty_pulls += 1
            continue
        empty_pulls = 0
        for received in response.received_messages:
            delivered[received.message.message_id] = received.message
        rpc.call(
            "Subscriber",
            "Acknowledge",
            AcknowledgeRequest(
                subscription=SUBSCRIPTION, ack_ids=[r.ack_id for r in response.received_messages]
            ),
            AcknowledgeRequest,  # Empty parses as any message; the content is not used.
        )
    return delivered


def _aio_stub(channel: grpc.aio.Channel, method: str) -> Any:
    rpc = RPCS[method]
    return channel.unary_unary(
        rpc.path,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=rpc.response_class.FromString,
    )


async def _raw_publish_until_killed(address: str, acknowledged: dict[str, bytes], publishers: int) -> int:
    """Publish batches from several tasks until the server goes away; return the failed calls."""
    failures = 0
    async with grpc.aio.insecure_channel(address) as channel:
        publish = _aio_stub(channel, "Publish")
        counter = iter(range(10**9))

        async def publisher(worker: int) -> None:
            nonlocal failures
            while True:
                datas = [f"w{worker}-m{next(counter)}".encode() for _ in range(random.randint(1, 50))]
                request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=data) for data in datas])
                try:
                    response = await publish(request, timeout=5)
                except grpc.aio.AioRpcError:
                    failures += 1
                    return
                assert len(response.message_ids) == len(datas)
                acknowledged.update(zip(response.message_ids, datas, strict=True))

        await asyncio.gather(*(publisher(worker) for worker in range(publishers)))
    return failures


def _create_topic_and_subscription(admin: Any) -> None:
    admin.call("Publisher", "CreateTopic", Topic(name=TOPIC), Topic)
    # Ack deadline at its maximum: nothing is redelivered while the final drain runs.
    admin.call(
        "Subscriber",
        "CreateSubscription",
        Subscription(name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=600),
        Subscription,
    )


def test_kill_9_while_raw_grpc_publishes_loses_no_acknowledged_message(
    server_process: Any, make_rpc: Callable[[str], Any]
) -> None:
    rng = random.Random(SEED)
    acknowledged: dict[str, bytes] = {}
    server_process.start()
    _create_topic_and_subscription(make_rpc(server_process.address))
    for round_number in range(ROUNDS):
        kill_after = rng.uniform(0.2, 0.2 + 0.4 * ROUND_SECONDS)
        timer = threading.Timer(kill_after, server_process.kill)
        timer.start()
        before = len(acknowledged)
        started = time.perf_counter()
        asyncio.run(_raw_publish_until_killed(server_process.address, acknowledged, publishers=4))
        timer.join()
        print(
            f"round {round_number}: killed after {kill_after:.2f} s "
            f"({time.perf_counter() - started:.2f} s), {len(acknowledged) - before} messages acknowledged"
        )
        assert len(acknowledged) > before, "nothing was published before the kill"
        server_process.start()
        # Topic and subscription come back with the data.
        got = make_rpc(server_process.address).call(
            "Subscriber", "GetSubscription", GetSubscriptionRequest(subscription=SUBSCRIPTION), Subscription
        )
        assert got.topic == TOPIC

    delivered = _drain(make_rpc(server_process.address))
    missing = set(acknowledged) - set(delivered)
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages lost"
    assert {message_id: delivered[message_id].data for message_id in acknowledged} == acknowledged


def test_no_acknowledged_message_is_lost_across_sigkill(
    server_process: Any, make_rpc: Callable[[str], Any]
) -> None:
    rng = random.Random(SEED)
    server_process.start()
    _create_topic_and_subscription(make_rpc(server_process.address))

    publisher = PublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=0.2, max_tokens=20, refill_ratio=0.1),
        batch_settings=BatchSettings(max_messages=50, max_latency=0.005),
        # Retries must outlast a restart (about a second here, more on a loaded machine).
        retry_settings=RetrySettings(
            initial_retry_delay=0.05,
            retry_delay_multiplier=1.5,
            max_retry_delay=0.5,
            initial_rpc_timeout=2.0,
            rpc_timeout_multiplier=1.5,
            max_rpc_timeout=5.0,
            total_timeout=120.0,
        ),
        endpoint=server_process.address,
    )
    ledger = Ledger()
    stop = threading.Event()
    sent = [0]
    producer = threading.Thread(
        target=_publish_until, args=(publisher, ledger, stop, sent, SEED), name="trust-producer", daemon=True
    )
    started = time.monotonic()
    producer.start()
    acknowledged_at_kill: list[int] = []
    restart_seconds: list[float] = []
    recovered_after: list[float] = []
    try:
        for _ in range(ROUNDS):
            # Kill only once the publisher is through to this server (its channel reconnects with
            # back-off), so that every kill meets batches in flight rather than an idle socket.
            recovered_after.append(_wait_for_progress(ledger, PROGRESS_MESSAGES, timeout=60))
            time.sleep(rng.uniform(0.0, ROUND_SECONDS))
            server_process.kill()
            with ledger.lock:
                acknowledged_at_kill.append(len(ledger.acknowledged))
            time.sleep(rng.uniform(0.0, 0.3))
            restart_seconds.append(server_process.start())
        # A last stretch of calm publishing, so that the final state is not only what the kills left.
        time.sleep(0.5)
    finally:
        stop.set()
        producer.join(10)
        publisher.shutdown(timeout=150)

    # The final restart: everything the drain sees comes from the SQLite file.
    server_process.kill()
    restart_seconds.append(server_process.start())
    reader = make_rpc(server_process.address)
    delivered = _drain(reader)
    elapsed = time.monotonic() - started

    lost = [message_id for message_id in ledger.acknowledged if message_id not in delivered]
    damaged = [
        message_id
        for message_id, (data, attributes) in ledger.acknowledged.items()
        if message_id in delivered
        and (delivered[message_id].data != data or dict(delivered[message_id].attributes) != attributes)
    ]
    stats = publisher.stats()
    print(
        f"\ncrash durability: rounds {ROUNDS} (SIGKILL + restart, plus a final one), "
        f"published {sent[0]}, acknowledged {len(ledger.acknowledged)}, failed {len(ledger.failures)}, "
        f"delivered {len(delivered)} (extra copies from retries/hedges: "
        f"{len(delivered) - len(ledger.acknowledged) + len(lost)}), lost {len(lost)}, "
        f"damaged {len(damaged)}; "
        f"acknowledged at each kill {acknowledged_at_kill}; restarts took "
        f"{min(restart_seconds):.2f}-{max(restart_seconds):.2f} s, publisher through again after "
        f"{min(recovered_after):.2f}-{max(recovered_after):.2f} s; attempts {stats.attempts_sent}, "
        f"hedges {stats.hedges_sent}; {elapsed:.1f} s in all"
    )
    assert ledger.acknowledged, "nothing was acknowledged: the test proved nothing"
    assert sent[0] == len(ledger.acknowledged) + len(ledger.failures), "a future never resolved"
    assert not ledger.duplicate_ids, (
        f"one message ID was returned for two messages: {ledger.duplicate_ids[:5]}"
    )
    assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {lost[:5]}"
    assert not damaged, f"{len(damaged)} messages came back changed, e.g. {damaged[:5]}"
    # Retries outlast every restart, so no publish should fail at all.
    assert not ledger.failures, f"{len(ledger.failures)} publishes failed; first: {ledger.failures[0]!r}"
