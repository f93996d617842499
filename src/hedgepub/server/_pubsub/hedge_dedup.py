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

Google Cloud Pub/Sub does not do this: there every copy is stored with its own message ID. The option
exists so that hedged runs against the local server can show zero duplicates, and to show what a server
that understands the batch id could offer; consumers of the real service drop copies with
:class:`hedgepub.dedup.Deduplicator` instead.
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class HedgeDedupCounts:
    """What the window did (a snapshot)."""

    #: Publishes that carried a batch key and were stored (first attempts, or repeats after a failure).
    stored: int = 0
    #: Later attempts answered with the message IDs of their batch's first commit, storing nothing.
    answered_from_window: int = 0
    #: Batches remembered now.
    batches: int = 0


@dataclass
class _Committed:
    ids: list[str]
    shape: tuple[int, int]
    at: float


class HedgeBatchWindow:
    """Committed batches by (topic, batch id), for a bounded time and number of IDs; one event loop."""

    def __init__(
        self,
        window: float = DEFAULT_WINDOW_SECONDS,
        *,
        max_ids: int = DEFAULT_MAX_IDS,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be seconds > 0; got {window!r}")
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1; got {max_ids!r}")
        self.window = float(window)
        self.max_ids = max_ids
        self._clock = clock
        self._committed: OrderedDict[tuple[str, str], _Committed] = OrderedDict()
        self._in_flight: dict[tuple[str, str], tuple[tuple[int, int], asyncio.Future[list[str]]]] = {}
        self._ids = 0
        self._stored = 0
        self._answered = 0

    @property
    def counts(self) -> HedgeDedupCounts:
        """A snapshot of the counters."""
        return HedgeDedupCounts(self._stored, self._answered, len(self._committed))

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
        key = (topic, batch_id)
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
            self._remember(key, _Committed(ids, shape, self._clock.now()))
            self._stored += 1
            return ids
        finally:
            if self._in_flight.get(key, (None, None))[1] is future:
                del self._in_flight[key]

    def _remember(self, key: tuple[str, str], committed: _Committed) -> None:
        previous = self._committed.pop(key, None)
        if previous is not None:
            self._ids -= len(previous.ids)
        self._committed[key] = committed
        self._ids += len(committed.ids)
        while self._ids > self.max_ids and len(self._committed) > 1:
            _, oldest = self._committed.popitem(last=False)
            self._ids -= len(oldest.ids)

    def _forget_old(self, now: float) -> None:
        committed = self._committed
        while committed:
            oldest = next(iter(committed.values()))
            if now - oldest.at <= self.window:
                return
            committed.popitem(last=False)
            self._ids -= len(oldest.ids)

    def __repr__(self) -> str:
        return f"<HedgeBatchWindow {self.window:g} s, {len(self._committed)} batches, {self._ids} IDs>"
