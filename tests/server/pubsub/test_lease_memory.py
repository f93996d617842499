"""An acknowledged message leaves memory when it is acknowledged, not when its lease's deadline passes."""

from __future__ import annotations

import gc

from hedgepub.server._pubsub.leases import Pending
from hedgepub.testing.virtual_time import run_virtual

from .test_delivery import SUBSCRIPTION, make_core, publish


def _messages_in_memory() -> int:
    """The 1 MB messages some object still holds (protobuf keeps their bytes outside Python's
    allocator, where tracemalloc cannot see them; their ``Pending`` records are what refers to them)."""
    gc.collect()
    return sum(1 for item in gc.get_objects() if isinstance(item, Pending) and item.size > 500_000)


def test_acknowledged_messages_are_freed_before_their_deadlines() -> None:
    async def scenario() -> tuple[int, int]:
        core = await make_core(ack_deadline_seconds=600)  # leases that would last 10 minutes
        for _ in range(20):
            await publish(core, b"x" * 1_000_000)
        received = 0
        while received < 20:  # 4 a response (4 MiB)
            batch = await core.consumers.pull(SUBSCRIPTION, 100, 0)
            received += len(batch)
            await core.consumers.acknowledge(SUBSCRIPTION, [message.ack_id for message in batch])
            del batch
        acknowledged = _messages_in_memory()
        await publish(core, b"y" * 1_000_000)
        (held,) = await core.consumers.pull(SUBSCRIPTION, 100, 0)
        leased = _messages_in_memory()
        await core.consumers.acknowledge(SUBSCRIPTION, [held.ack_id])
        return acknowledged, leased

    acknowledged, leased = run_virtual(scenario())
    # The lease-deadline heap kept all 20 until their deadlines, 10 minutes away.
    assert (acknowledged, leased) == (0, 1)
