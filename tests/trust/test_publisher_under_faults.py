"""The hedging publisher against a server failing 20% of Publish calls and stalling 2% for seconds.

Every future must resolve, none may fail, every returned message ID must be stored on the server, and
the duplicates that hedging and retries cost are counted and printed.

Settings (environment variables):

- ``HEDGEPUB_TRUST_MESSAGES``: messages to publish (default 20000).
- ``HEDGEPUB_TRUST_SEED``: seed of the fault draws (default 20261129).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections import Counter

import pytest

from hedgepub import BatchSettings, HedgingSettings, PublisherClient, RetrySettings, StatusCode
from hedgepub.bench import AdminClient
from hedgepub.server import FaultInjector, FaultRule, LocalServer

MESSAGES = int(os.environ.get("HEDGEPUB_TRUST_MESSAGES", "") or 20_000)
SEED = int(os.environ.get("HEDGEPUB_TRUST_SEED", "") or 20261129)
TOPIC = "projects/trust/topics/under-faults"
#: 2% of Publish calls stall for 3 s before the handler runs (so before the commit); the rest take 1 ms.
LATENCY = "98%:1ms,2%:3s"
UNAVAILABLE_RATE = 0.20

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240 + MESSAGES // 100)]


def test_every_future_resolves_and_every_id_is_stored_under_faults() -> None:
    faults = FaultInjector(
        {"Publish": FaultRule(latency=LATENCY, errors={StatusCode.UNAVAILABLE: UNAVAILABLE_RATE})},
        seed=SEED,
    )
    with LocalServer(in_memory=True, faults=faults) as server:
        # The topic is created over gRPC too; the rule is on Publish only, so this call is not faulted.
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)

        publisher = PublisherClient(
            hedging_settings=HedgingSettings(hedge_delay=0.3, max_tokens=50, refill_ratio=0.1),
            # Small batches: many RPCs, so the 20% / 2% draws happen thousands of times.
            batch_settings=BatchSettings(max_messages=10, max_latency=0.005),
            # Short back-off so UNAVAILABLE is retried quickly; a 1 s attempt timeout cuts the 3 s stalls.
            retry_settings=RetrySettings(
                initial_retry_delay=0.01,
                retry_delay_multiplier=2.0,
                max_retry_delay=0.5,
                initial_rpc_timeout=1.0,
                rpc_timeout_multiplier=2.0,
                max_rpc_timeout=8.0,
                total_timeout=120.0,
            ),
            endpoint=server.address,
        )
        started = time.perf_counter()
        payloads = [f"message-{index:06d}".encode() for index in range(MESSAGES)]
        futures = [
            publisher.publish(TOPIC, payload, index=str(index)) for index, payload in enumerate(payloads)
        ]
        _, not_done = concurrent.futures.wait(futures, timeout=180)
        publisher.shutdown(timeout=30)
        elapsed = time.perf_counter() - started
        stats = publisher.stats()

        assert not not_done, f"{len(not_done)} of {MESSAGES} futures did not resolve within 180 s"
        failures = [future.exception() for future in futures if future.exception() is not None]
        assert not failures, f"{len(failures)} publishes failed; first: {failures[0]!r}"
        returned = {future.result(): payload for future, payload in zip(futures, payloads, strict=True)}
        assert len(returned) == MESSAGES, "two messages were given the same message ID"

        stored = server.messages(TOPIC)
        stored_by_id = {message.message_id: message for message in stored}
        missing = [message_id for message_id in returned if message_id not in stored_by_id]
        assert not missing, f"{len(missing)} returned message IDs are not on the server: {missing[:5]}"
        for message_id, payload in returned.items():
            assert stored_by_id[message_id].data == payload
        copies = Counter(message.data for message in stored)
        assert set(copies) == set(payloads), "the server holds a payload that was never published"
        duplicates = len(stored) - len(copies)
        publish_faults = faults.counts["Publish"]
        stalls = publish_faults.delays.get(3.0, 0)
        unavailable = publish_faults.errors.get(StatusCode.UNAVAILABLE, 0)
        print(
            f"\npublisher under faults: {MESSAGES} messages in {elapsed:.1f} s, failures 0, "
            f"stored {len(stored)}, duplicates {duplicates} ({duplicates / MESSAGES:.2%}); "
            f"batches {stats.batches_sent}, attempts {stats.attempts_sent}, hedges sent {stats.hedges_sent}, "
            f"won {stats.hedges_won}, skipped {stats.hedges_skipped}; Publish calls {publish_faults.calls}, "
            f"injected UNAVAILABLE {unavailable}, 3 s stalls {stalls} "
            f"({publish_faults.cancelled_during_delay} cut short by the client); "
            f"batch latency p50 {stats.p50_ms:.0f} ms, p99 {stats.p99_ms:.0f} ms, max {stats.max_ms:.0f} ms"
        )
        assert stats.messages_failed == 0
        assert stats.messages_published == MESSAGES
