"""``hedgepub serve --dedup-hedges``: store a hedged batch once, however many of its copies arrive.

The attempts of one batch are told apart from an unrelated publish by a key they share: hedgepub's
publisher sends every attempt of a batch (the original, its retries, its hedges) with the same
``hedgepub-batch-id`` metadata (docs/hedging.md, rule 8); Google's Java, Go and Rust clients send the
same ``publish_start_time`` in the ``x-goog-pubsub-client-telemetry`` header of each attempt, so that the
start time and the messages themselves make the key
(:func:`~hedgepub.server._api.client_telemetry.telemetry_batch_key`; a header without a start time makes
none). With this opt-in window the local server remembers, for a while, the message IDs it answered for
each (topic, key): a later attempt of a batch already committed gets the first attempt's message IDs
instead of being stored again, and an attempt that arrives while another attempt of its batch is being
committed waits for that commit and gets its IDs. If the first attempt fails, the one waiting is stored
on its own. A repeated key whose request differs (another number of messages or of bytes) is not the
same batch and is stored as usual.

The window is bounded in bytes as well as in time and message IDs: each batch is remembered by a 16-byte
digest of its topic and key, never by the key itself, so a client's 7 KB ``hedgepub-batch-id`` costs what
a short one costs; each batch is charged :data:`ENTRY_BYTES` plus :data:`ID_BYTES` and the length of each
of its message IDs, and the oldest batches are forgotten first once ``max_bytes`` would be exceeded.

Google Cloud Pub/Sub does not do this: there every copy is stored with its own message ID. The option
exists so that hedged runs against the local server can show zero duplicates, and to show what a server
that understands the batch id could offer; consumers of the real service drop copies with
:class:`hedgepub.dedup.Deduplicator` instead.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub._wire import BATCH_ID_KEY

#: The metadata key hedgepub's publisher puts its batch id in.
BATCH_ID_METADATA = BATCH_ID_KEY
#: How long a committed batch is remembered: the publisher's default total timeout, within which every
#: attempt of a batch is sent.
DEFAULT_WINDOW_SECONDS = 600.0
#: Most message IDs remembered at once (the oldest batches are forgotten first).
DEFAULT_MAX_IDS = 1_000_000
#: Most bytes the remembered batches may take (digests, records, message IDs); the oldest go first.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
#: What one remembered batch costs apart from its message IDs (its digest, its record, its slot in the
#: window), measured with ``tracemalloc`` on CPython 3.12 and rounded up.
ENTRY_BYTES = 352
#: What one remembered message ID costs apart from its characters (the string object and its slot).
ID_BYTES = 58


@dataclass(frozen=True)
class HedgeDedupCounts:
    """What the window did (a snapshot)."""

    #: Publishes that carried a batch key and were stored (first attempts, or repeats after a failure).
    stored: int = 0
    #: Later attempts answered with the message IDs of their batch's first commit, storing nothing.
    answered_from_window: int = 0
    #: Batches remembered now.
    batches: int = 0
    #: Bytes the remembered batches are charged now (at most ``max_bytes``).
    remembered_bytes: int = 0


@dataclass(slots=True)
class _Committed:
    ids: tuple[str, ...]
    shape: tuple[int, int]
    at: float
    cost: int


def _digest(topic: str, batch_id: str) -> bytes:
    """The window's key for ``batch_id`` on ``topic``: 16 bytes, however long the id."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(topic.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(batch_id.encode("utf-8", "surrogatepass"))
    return digest.digest()


def _cost(ids: Sequence[str]) -> int:
    return ENTRY_BYTES + sum(ID_BYTES + len(message_id) for message_id in ids)


class HedgeBatchWindow:
    """Committed batches by (topic, batch id), for a bounded time, number of IDs and bytes; one event loop."""

    def __init__(
        self,
        window: float = DEFAULT_WINDOW_SECONDS,
        *,
        max_ids: int = DEFAULT_MAX_IDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be seconds > 0; got {window!r}")
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1; got {max_ids!r}")
        if max_bytes < ENTRY_BYTES:
            raise ValueError(f"max_bytes must be >= {ENTRY_BYTES}; got {max_bytes!r}")
        self.window = float(window)
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self._clock = clock
        self._committed: OrderedDict[bytes, _Committed] = OrderedDict()
        self._in_flight: dict[bytes, tuple[tuple[int, int], asyncio.Future[list[str]]]] = {}
        self._ids = 0
        self._bytes = 0
        self._stored = 0
        self._answered = 0

    @property
    def counts(self) -> HedgeDedupCounts:
        """A snapshot of the counters."""
        return HedgeDedupCounts(self._stored, self._answered, len(self._committed), self._bytes)

    async def publish_once(
        self,
        topic: str,
        batch_id: str,
        shape: tuple[int, int],
        publish: Callable[[], Awaitable[Sequence[str]]],
    ) -> list[str]:
        """The message IDs of batch ``batch_id`` on ``topic``: its first commit's, or ``publish()``'s.

        ``shape`` (message count, request bytes) tells a repeat of the same batch from a reused id.
        """
        key = _digest(topic, batch_id)
        while True:
            self._forget_old(self._clock.now())
            committed = self._committed.get(key)
            if committed is not None and committed.shape == shape:
                self._answered += 1
                return list(committed.ids)
            running = self._in_flight.get(key)
            if running is None or running[0] != shape:
                break
            try:
                ids = await asyncio.shield(running[1])
            except Exception:
                # That attempt failed: look again, since another waiting attempt may be committing now.
                continue
            self._answered += 1
            return list(ids)
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = (shape, future)
        try:
            ids = list(await publish())
        except BaseException as error:
            if not future.done():
                future.set_exception(error if isinstance(error, Exception) else RuntimeError("cancelled"))
                future.exception()  # retrieved here, so that no waiter-less future is logged
            raise
        else:
            future.set_result(ids)
            remembered = tuple(ids)
            self._remember(key, _Committed(remembered, shape, self._clock.now(), _cost(remembered)))
            self._stored += 1
            return ids
        finally:
            if self._in_flight.get(key, (None, None))[1] is future:
                del self._in_flight[key]

    def _remember(self, key: bytes, committed: _Committed) -> None:
        if committed.cost > self.max_bytes or len(committed.ids) > self.max_ids:
            return  # a batch bigger than the whole window is not remembered (its repeats are stored)
        previous = self._committed.pop(key, None)
        if previous is not None:
            self._drop(previous)
        self._committed[key] = committed
        self._ids += len(committed.ids)
        self._bytes += committed.cost
        while (self._ids > self.max_ids or self._bytes > self.max_bytes) and len(self._committed) > 1:
            self._drop(self._committed.popitem(last=False)[1])

    def _drop(self, committed: _Committed) -> None:
        self._ids -= len(committed.ids)
        self._bytes -= committed.cost

    def _forget_old(self, now: float) -> None:
        committed = self._committed
        while committed:
            oldest = next(iter(committed.values()))
            if now - oldest.at <= self.window:
                return
            committed.popitem(last=False)
            self._drop(oldest)

    def __repr__(self) -> str:
        return (
            f"<HedgeBatchWindow {self.window:g} s, {len(self._committed)} batches, {self._ids} IDs, "
            f"{self._bytes} bytes>"
        )
