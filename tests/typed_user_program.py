"""A user's program, type-checked (never run) by tests/test_typing.py with the flags of mypy's strict mode.

It calls hedgepub's public names as the docs describe them and states the types a user's type checker
must see: a change to an annotation that breaks a user's type checking fails that test. Keep it to the
public API (``hedgepub``, ``hedgepub.server``, ``hedgepub.testing``, ``hedgepub.admin``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
from typing import assert_type

import hedgepub
from hedgepub import (
    AdaptiveDelay,
    AsyncPublisherClient,
    BatchSettings,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    PublisherClient,
    PublisherStats,
    RetrySettings,
    StatusCode,
)
from hedgepub.server import FaultRule, LocalServer, StoredMessage

TOPIC = "projects/my-project/topics/my-topic"


def settings() -> HedgingSettings:
    # Durations are seconds or timedeltas, and read back as float seconds.
    hedging = HedgingSettings(hedge_delay=datetime.timedelta(milliseconds=500), max_tokens=100)
    assert_type(hedging.hedge_delay, float)
    adaptive = HedgingSettings(
        adaptive_delay=AdaptiveDelay(percentile=99, window=datetime.timedelta(seconds=30))
    )
    assert_type(adaptive.adaptive_delay, AdaptiveDelay | None)
    retry = RetrySettings(
        total_timeout=datetime.timedelta(minutes=1), retryable_codes={StatusCode.UNAVAILABLE}
    )
    assert_type(retry.total_timeout, float)
    assert_type(retry.retryable_codes, frozenset[StatusCode])
    BatchSettings(max_messages=500, max_latency=datetime.timedelta(milliseconds=5))
    FlowControlSettings(message_limit=1000, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    hedgepub.check_hedging(hedging, retry)
    return hedging


def publish_sync() -> list[str]:
    with LocalServer(in_memory=True) as server:
        assert_type(server.address, str)
        server.faults.set("Publish", FaultRule(latency="95%:1ms,5%:300ms"))
        with PublisherClient(endpoint=server.address, hedging_settings=settings()) as publisher:
            future = publisher.publish(TOPIC, b"hello", origin="typed")
            assert_type(future, concurrent.futures.Future[str])
            ids = [future.result(timeout=30)]
            stats = publisher.stats()
            assert_type(stats, PublisherStats)
            assert_type(stats.hedges_sent, int)
        stored = server.messages(TOPIC)
        assert_type(stored, list[StoredMessage])
        assert_type(stored[0].data, bytes)
    return ids


async def publish_async(endpoint: str) -> str:
    async with AsyncPublisherClient(endpoint=endpoint) as publisher:
        message_id = await publisher.publish(TOPIC, b"hello", ordering_key="")
        assert_type(message_id, str)
        await publisher.shutdown(timeout=5)
    return message_id


def errors(future: concurrent.futures.Future[str]) -> StatusCode | None:
    try:
        future.result()
    except hedgepub.RpcError as error:
        assert_type(error.code, StatusCode)
        return error.code
    except hedgepub.PublishError as error:
        assert_type(error.code, StatusCode | None)
        return error.code
    return None


if __name__ == "__main__":
    print(publish_sync(), asyncio.run(publish_async("127.0.0.1:8085")))
