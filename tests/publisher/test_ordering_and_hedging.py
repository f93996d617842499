"""Ordering keys and hedging in one publisher, against the real local server with slow publishes.

A batch with an ordering key is never hedged and leaves its topic's token bucket alone; batches without
one are hedged as usual (docs/hedging.md, rule 23).
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from hedgepub import BatchSettings, HedgingSettings, PublisherClient, RetrySettings
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.bench import AdminClient
from hedgepub.server import FaultInjector, FaultRule, LocalServer
from hedgepub.server._api.handlers import behavior_of, rebuilt

PUBLISH = "/google.pubsub.v1.Publisher/Publish"


class AttemptRecorder(FaultInjector):
    """The server's fault injector, also noting for every Publish call that arrives its attempt number
    (from the telemetry header) and the ordering keys of its messages, before any injected delay."""

    def __init__(self) -> None:
        super().__init__()
        #: (hedged_attempt_count, ordering keys of the request's messages), in order of arrival.
        self.attempts: list[tuple[int, frozenset[str]]] = []

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await super().intercept_service(continuation, handler_call_details)
        if handler_call_details.method != PUBLISH or handler is None:
            return handler
        metadata = dict(handler_call_details.invocation_metadata)
        attempt = decode_client_telemetry(metadata[CLIENT_TELEMETRY_KEY])[0]
        behavior = behavior_of(handler)

        async def recorded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.attempts.append((attempt, frozenset(m.ordering_key for m in request.messages)))
            return await behavior(request, context)

        return rebuilt(handler, recorded)


def test_keyed_batches_keep_their_order_and_unkeyed_ones_are_hedged() -> None:
    recorder = AttemptRecorder()
    topic = "projects/test-project/topics/mixed"
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=50, refill_ratio=0.2)
    retry = RetrySettings(initial_rpc_timeout=5.0)
    with LocalServer(in_memory=True, faults=recorder) as server, AdminClient(server.address) as admin:
        admin.create_topic(topic)
        with PublisherClient(
            hedging,
            BatchSettings(max_messages=1),
            retry,
            enable_message_ordering=True,
            endpoint=server.address,
        ) as publisher:
            for _ in range(25):  # unkeyed successes fill the topic's bucket: 5 tokens
                publisher.publish(topic, b"warm-up").result(timeout=10)
            tokens = publisher.stats().tokens_by_topic[topic]
            assert tokens == 5.0
            # A publish in two is held 300 ms before the server stores it: a hedge sent after 100 ms
            # finds its own draw, and the keyed batches behind a slow one wait their turn.
            server.faults.seed(7)
            server.faults.set("Publish", FaultRule(latency="50%:300ms"))
            keyed = {
                key: [
                    publisher.publish(topic, b"%s %d" % (key.encode(), i), ordering_key=key) for i in range(8)
                ]
                for key in ("a", "b")
            }
            unkeyed = [publisher.publish(topic, b"unkeyed %d" % i) for i in range(16)]
            for future in [*keyed["a"], *keyed["b"], *unkeyed]:
                future.result(timeout=30)
            stats = publisher.stats()
        stored = server.messages(topic)
    for key in ("a", "b"):
        in_order = [m.data for m in stored if m.ordering_key == key]
        assert in_order == [b"%s %d" % (key.encode(), i) for i in range(8)]  # in order, each stored once
    hedged = [keys for attempt, keys in recorder.attempts if attempt > 0]
    assert hedged and all(keys == {""} for keys in hedged)  # hedges went out, none for a keyed batch
    assert stats.unhedged_keyed_batches == 16
    assert 0 < len(hedged) <= stats.hedges_sent  # (a hedge cancelled on its way may never arrive)
    # The keyed batches neither spent nor refilled the bucket: only the unkeyed ones did.
    refills = 0.2 * len(unkeyed)
    assert stats.tokens_by_topic[topic] == pytest.approx(tokens - stats.hedges_sent + refills)
