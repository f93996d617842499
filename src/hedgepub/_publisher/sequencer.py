"""The ordering-key sequencer: at most one batch in flight per ordering key, the rest waiting in order.

Messages with an ordering key must reach Pub/Sub in the order they were published, so the batches of one
``(topic, ordering_key)`` are sent one after the other: a batch whose key has one in flight waits behind
it, and the next goes when it succeeds. When one fails, its key is *paused*: what waits behind it fails
too, and the key refuses messages until ``resume_publish``. Batches without an ordering key never come
here.

The sequencer runs on the publisher's loop, except :attr:`paused`, which the publisher reads and changes
under its own lock from any thread (a paused key must refuse the very next message, whichever thread
publishes it).
"""

from __future__ import annotations

from collections import deque

from hedgepub._publisher.batch import Batch, BatchState

#: An ordering key with its topic: ``(topic, ordering_key)``.
Key = tuple[str, str]


class _KeyQueue:
    """The batches of one ordering key: at most one in flight, the rest waiting in order."""

    __slots__ = ("in_flight", "waiting")

    def __init__(self) -> None:
        self.in_flight = False
        self.waiting: deque[Batch] = deque()


class OrderingSequencer:
    """Which batch of each ordering key may be sent now."""

    def __init__(self) -> None:
        self._keys: dict[Key, _KeyQueue] = {}
        #: Keys refused until resumed (read and changed under the publisher's lock).
        self.paused: set[Key] = set()

    def admit(self, batch: Batch) -> bool:
        """Whether ``batch`` (sealed, with an ordering key) may be sent now; if not, it waits its turn."""
        key = (batch.topic, batch.ordering_key)
        queue = self._keys.get(key)
        if queue is None:
            queue = self._keys[key] = _KeyQueue()
        if queue.in_flight:
            batch.move(BatchState.QUEUED)
            queue.waiting.append(batch)
            return False
        queue.in_flight = True
        return True

    def succeeded(self, key: Key) -> Batch | None:
        """The batch in flight on ``key`` succeeded: the next one to send, or ``None`` (the key is idle)."""
        queue = self._keys.get(key)
        if queue is None:
            return None
        if queue.waiting:
            return queue.waiting.popleft()
        del self._keys[key]
        return None

    def pause(self, key: Key) -> list[Batch]:
        """A batch on ``key`` failed: pause the key and return the batches that waited behind it."""
        self.paused.add(key)
        queue = self._keys.pop(key, None)
        return list(queue.waiting) if queue is not None else []

    def take_waiting(self) -> list[Batch]:
        """Every waiting batch, taken out of its queue (shutdown fails them); in-flight ones stay."""
        taken: list[Batch] = []
        for queue in list(self._keys.values()):
            taken += queue.waiting
            queue.waiting = deque()
        return taken

    def forget(self) -> list[Batch]:
        """Drop everything (a forked child); return the batches that were waiting."""
        waiting = [batch for queue in self._keys.values() for batch in queue.waiting]
        self._keys = {}
        return waiting
