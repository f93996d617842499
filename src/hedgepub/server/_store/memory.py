"""The in-memory :class:`~hedgepub.server._store.protocol.Store`: nothing survives the process."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from hedgepub.server._store.batch import Batch
from hedgepub.server._store.protocol import (
    HOLDING_KINDS,
    RESOURCE_CLASSES,
    ResourceKind,
    Snapshot,
    Store,
)


class _References:
    """One subscription's references in the in-memory store: live sequences, plus their order for paging.

    Sequences are only ever added in increasing order, so ``order`` stays sorted; acknowledged ones are
    dropped from ``live`` at once and from ``order`` in a compaction once they are half of it.
    ``attempts`` holds the recorded delivery attempts of the live sequences that have any.
    """

    __slots__ = ("attempts", "live", "order")

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.order: list[int] = []
        self.attempts: dict[int, int] = {}

    def add_range(self, first: int, end: int) -> None:
        """Reference ``first`` .. ``end - 1``, all above every sequence referenced so far (a new batch):
        two C-level loops, no Python work per message."""
        self.live.update(range(first, end))
        self.order.extend(range(first, end))

    def insert(self, sequence: int) -> bool:
        """Add one sequence anywhere in the order (replay adds older ones); whether it was new."""
        if sequence in self.live:
            return False
        self.live.add(sequence)
        order = self.order
        if not order or order[-1] < sequence:
            order.append(sequence)
        else:
            index = bisect.bisect_left(order, sequence)
            if index == len(order) or order[index] != sequence:
                order.insert(index, sequence)
        return True

    def remove(self, sequence: int) -> bool:
        try:
            self.live.remove(sequence)
        except KeyError:
            return False
        if self.attempts:
            self.attempts.pop(sequence, None)
        if len(self.order) > 2 * len(self.live) + 1024:
            live = self.live
            self.order = [kept for kept in self.order if kept in live]
        return True

    def between(self, low: int, high: int) -> list[int]:
        """The live sequences in ``[low, high)``, in order."""
        order, live = self.order, self.live
        start = bisect.bisect_left(order, low)
        end = bisect.bisect_left(order, high)
        return [sequence for sequence in order[start:end] if sequence in live]

    def after(self, sequence: int, limit: int) -> list[int]:
        order, live = self.order, self.live
        found: list[int] = []
        index = bisect.bisect_right(order, sequence)
        while index < len(order) and len(found) < limit:
            candidate = order[index]
            if candidate in live:
                found.append(candidate)
            index += 1
        return found


class _StoredBatch:
    """A batch in the in-memory store, with the count of references to each of its messages; a message
    whose count reaches zero is gone, and the batch with its last message."""

    __slots__ = ("batch", "counts", "live")

    def __init__(self, batch: Batch, references: int) -> None:
        self.batch = batch
        self.counts = [references] * len(batch)
        #: Messages with a reference.
        self.live = len(batch)

    def holds(self, sequence: int) -> bool:
        """Whether message ``sequence`` is in the batch and still referenced."""
        index = sequence - self.batch.first
        return 0 <= index < len(self.counts) and self.counts[index] > 0

    def unreference(self, sequence: int) -> bool:
        """Drop one reference to a message the batch holds; whether the batch is now empty."""
        index = sequence - self.batch.first
        self.counts[index] -= 1
        if self.counts[index] == 0:
            self.live -= 1
        return self.live == 0

    def live_sequences(self) -> Iterator[int]:
        """The sequences of the messages still referenced, in order."""
        first = self.batch.first
        return (first + index for index, count in enumerate(self.counts) if count > 0)


class MemoryStore(Store):
    """A :class:`Store` in memory: nothing survives the process; every write is immediate.

    ``keep_unsubscribed``: keep messages published while their topic has no subscription (for
    ``LocalServer.messages``); the real service, and the default, drop them.
    """

    def __init__(self, *, keep_unsubscribed: bool = False) -> None:
        self.keep_unsubscribed = keep_unsubscribed
        self._resources: dict[str, dict[str, Any]] = {kind: {} for kind in RESOURCE_CLASSES}
        #: The stored batches by first sequence, in insertion (so publish) order, and their first
        #: sequences in order for bisection (deleted ones stay in the list until a compaction).
        self._batches: dict[int, _StoredBatch] = {}
        self._starts: list[int] = []
        self._references: dict[str, _References] = {}
        self._leases: dict[str, dict[int, tuple[int, str, int]]] = {}
        self._activity: dict[str, int] = {}
        self._next_sequence = 1

    def load(self) -> Snapshot:
        """Return copies of the resources held."""
        snapshot = Snapshot(next_sequence=self._next_sequence, activity=dict(self._activity))
        for kind, target in (
            ("topics", snapshot.topics),
            ("subscriptions", snapshot.subscriptions),
            ("policies", snapshot.policies),
            ("schemas", snapshot.schemas),
            ("snapshots", snapshot.snapshots),
        ):
            for name, body in self._resources[kind].items():
                target[name] = _copy(body)
        return snapshot

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Keep a copy, so later changes by the caller do not leak in."""
        self._resources[kind][name] = _copy(body)
        if kind in HOLDING_KINDS:
            self._references.setdefault(name, _References())

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Drop the resource (and a subscription's references and activity)."""
        self._resources[kind].pop(name, None)
        if kind == "subscriptions":
            self._activity.pop(name, None)
        if kind in HOLDING_KINDS:
            await self.release(name)

    async def append(self, batch: Batch, subscriptions: Sequence[str]) -> None:
        """Keep the batch as it is, referenced by each subscription: the hot path of the in-memory server,
        so nothing here is done per message in Python."""
        if not batch.messages:
            return
        self._next_sequence = max(self._next_sequence, batch.end)
        holders = list(dict.fromkeys(subscriptions))
        if not holders and not self.keep_unsubscribed:
            return  # nobody will ever read them
        # An unsubscribed message kept for messages() holds one reference that is never dropped.
        self._batches[batch.first] = _StoredBatch(batch, len(holders) or 1)
        self._starts.append(batch.first)
        references = self._references
        for holder in holders:
            held = references.get(holder)
            if held is None:  # not setdefault: that would build an empty _References on every call
                held = references[holder] = _References()
            held.add_range(batch.first, batch.end)

    async def reserve(self, last: int) -> None:
        """Keep the next sequence above ``last``."""
        self._next_sequence = max(self._next_sequence, last + 1)

    def _find(self, sequence: int) -> _StoredBatch | None:
        """The stored batch holding ``sequence``, if that message is still stored."""
        starts = self._starts
        index = bisect.bisect_right(starts, sequence) - 1
        if index < 0:
            return None
        stored = self._batches.get(starts[index])
        if stored is None or not stored.holds(sequence):
            return None
        return stored

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Drop acknowledged references, and the messages nothing references any more."""
        references = self._references.get(subscription)
        if references is None:
            return
        for sequence in sequences:
            if references.remove(sequence):
                self._unreference(sequence)

    def _unreference(self, sequence: int) -> None:
        stored = self._find(sequence)
        if stored is not None and stored.unreference(sequence):
            del self._batches[stored.batch.first]
            if len(self._starts) > 2 * len(self._batches) + 1024:
                self._starts = list(self._batches)

    def pending(self, subscription: str, after: int, limit: int, max_bytes: int = 0) -> list[tuple[int, Any]]:
        """A page of the subscription's referenced messages (the stored objects, not copies; they are in
        memory already, so ``max_bytes`` changes nothing here)."""
        references = self._references.get(subscription)
        if references is None:
            return []
        page = []
        stored: _StoredBatch | None = None
        for sequence in references.after(after, limit):
            if stored is None or not stored.batch.first <= sequence < stored.batch.end:
                stored = self._find(sequence)
                if stored is None:
                    continue
            page.append((sequence, stored.batch.message(sequence)))
        return page

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message still stored on ``topic``, in publish order."""
        return [
            (sequence, stored.batch.message(sequence))
            for stored in self._batches.values()
            if stored.batch.topic == topic
            for sequence in stored.live_sequences()
        ]

    async def register(self, holder: str) -> None:
        """Give ``holder`` an (empty) set of references."""
        self._references.setdefault(holder, _References())

    async def release(self, holder: str) -> None:
        """Drop ``holder`` and its references (and a subscription's leases)."""
        self._leases.pop(holder, None)
        references = self._references.pop(holder, None)
        if references is not None:
            for sequence in references.live:
                self._unreference(sequence)

    async def put_snapshot(self, name: str, body: Any, source: str) -> None:
        """The snapshot and its references, with nothing awaited between (see :class:`Store`)."""
        await self.put("snapshots", name, body)
        await self.reference(name, self.referenced(source))

    async def reference(self, holder: str, sequences: Iterable[int]) -> None:
        """Reference stored messages from ``holder``."""
        references = self._references.setdefault(holder, _References())
        for sequence in sequences:
            stored = self._find(sequence)
            if stored is not None and references.insert(sequence):
                stored.counts[sequence - stored.batch.first] += 1

    def referenced(self, holder: str, low: int = 0, high: int | None = None) -> list[int]:
        """The sequences ``holder`` references in ``[low, high)``."""
        references = self._references.get(holder)
        if references is None:
            return []
        return references.between(low, high if high is not None else 2**62)

    async def put_leases(self, subscription: str, leases: Sequence[tuple[int, str, int]]) -> None:
        """Record leases."""
        table = self._leases.setdefault(subscription, {})
        for lease in leases:
            table[lease[0]] = lease

    async def drop_leases(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget leases."""
        table = self._leases.get(subscription)
        if table is not None:
            for sequence in sequences:
                table.pop(sequence, None)

    def leases(self, subscription: str) -> list[tuple[int, str, int]]:
        """The recorded leases."""
        return sorted(self._leases.get(subscription, {}).values())

    async def record_attempts(self, subscription: str, attempts: Sequence[tuple[int, int]]) -> None:
        """Keep the counts on the subscription's live references."""
        references = self._references.get(subscription)
        if references is None:
            return
        live, recorded = references.live, references.attempts
        for sequence, count in attempts:
            if sequence in live:
                recorded[sequence] = count

    def attempts(self, subscription: str, after: int, through: int) -> dict[int, int]:
        """The recorded counts in ``(after, through]``."""
        references = self._references.get(subscription)
        if references is None or not references.attempts:
            return {}
        recorded = references.attempts
        if len(recorded) <= through - after:
            return {sequence: count for sequence, count in recorded.items() if after < sequence <= through}
        return {
            sequence: recorded[sequence]
            for sequence in references.between(after + 1, through + 1)
            if sequence in recorded
        }

    async def put_activity(self, activity: Sequence[tuple[str, int]]) -> None:
        """Keep the records of existing subscriptions."""
        subscriptions = self._resources["subscriptions"]
        for name, active_ns in activity:
            if name in subscriptions:
                self._activity[name] = active_ns

    def first_sequence_at(self, publish_ns: int) -> int | None:
        """Binary search over the stored batches, which are in publish order (a batch's messages share
        its publish time)."""
        batches = list(self._batches.values())
        low, high = 0, len(batches)
        while low < high:
            middle = (low + high) // 2
            if batches[middle].batch.publish_ns < publish_ns:
                low = middle + 1
            else:
                high = middle
        return next(batches[low].live_sequences()) if low < len(batches) else None

    async def clear(self) -> None:
        """Forget everything (the sequence keeps counting, so IDs stay unique)."""
        for table in self._resources.values():
            table.clear()
        self._batches.clear()
        self._starts.clear()
        self._references.clear()
        self._leases.clear()
        self._activity.clear()

    async def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        counts = {kind: len(table) for kind, table in self._resources.items()}
        messages = sum(stored.live for stored in self._batches.values())
        return f"MemoryStore({counts}, messages={messages})"


def _copy(body: Any) -> Any:
    duplicate = type(body)()
    duplicate.CopyFrom(body)
    return duplicate
