"""Store tests write (sequence, message) records; the stores take batches: this groups them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hedgepub.server import Store
from hedgepub.server._store.batch import Batch


def batches(topic: str, records: Sequence[tuple[int, Any]]) -> list[Batch]:
    """``records`` as batches of consecutive sequences sharing a publish time (the message's, as set)."""
    grouped: list[Batch] = []
    for sequence, message in records:
        stamp = message.publish_time
        publish_ns = stamp.seconds * 1_000_000_000 + stamp.nanos
        last = grouped[-1] if grouped else None
        if last is not None and last.end == sequence and last.publish_ns == publish_ns:
            last.messages.append(message)
        else:
            grouped.append(Batch(sequence, topic, publish_ns, [message]))
    return grouped


async def append(
    store: Store, topic: str, records: Sequence[tuple[int, Any]], holders: Sequence[str]
) -> None:
    """Append ``records`` to ``store`` as :func:`batches`, referenced by ``holders``."""
    for batch in batches(topic, records):
        await store.append(batch, holders)
