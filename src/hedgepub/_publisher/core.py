"""The publisher's core, :class:`_PublisherCore`: the hot path from ``publish`` to a batch on its way.

The core appends messages to open batches, seals them and hands them to the sender; it runs on one asyncio
event loop. It is built, with every part it uses, by :func:`hedgepub._publisher.builder.build_core`:
messages are checked by :mod:`.messages`, ordering keys sequenced by :mod:`.sequencer`, batches sent
through the hedging engine by :mod:`.sender`, and each finished batch reported once to the observer of
:mod:`.observer` (stats, endpoints, telemetry). ``AsyncPublisherClient`` uses the core on the caller's
loop; ``PublisherClient`` runs it on a private event-loop thread (:mod:`hedgepub._publisher.loop_thread`)
and is safe to call from any thread. Its end (shutdown, and abandoning its messages in a forked child) is
in :mod:`hedgepub._publisher.closing`; ``publish_many``'s way into batches in :mod:`.bulk`; sending a
request that exists already (``hedgepub proxy``'s) in :mod:`hedgepub._publisher.forwarding`.

The hot path is built for throughput:

* ``publish`` validates, then adds the message to the open batch as the bytes it takes in the request
  (see :mod:`hedgepub._publisher.batch`: no protobuf object, no proto-plus, no task per message), under
  that batch's own lock; a message of data alone goes in within one call
  (:meth:`_PublisherCore.sync_publish`);
* threads do not wait for each other: messages without an ordering key go into an open batch of the
  publishing thread's own (per topic), found, filled, sealed and replaced without the publisher's lock
  (each batch has its own), so eight threads sharing one client publish as fast as one. Messages with an
  ordering key share one batch per key whatever the thread, opened under the publisher's lock, so that a
  message published after another (in any thread) is never sent before it;
* batches sealed or opened by another thread are handed to the loop through one queue (a deque), with at
  most one ``call_soon_threadsafe`` wake-up pending at a time however many batches are waiting;
* a batch's futures are resolved together (see :mod:`hedgepub._publisher.futures`).

Each sealed batch becomes one task that the sender runs through the hedging engine
(:func:`hedgepub._hedging.engine.run_batch`): retries, back-off, deadlines and hedges all come from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import TYPE_CHECKING, Any

from hedgepub._clock import Clock, TimerHandle
from hedgepub._exceptions import OrderingKeyPausedError, PublishError
from hedgepub._hedging.budget import HedgingBudget
from hedgepub._publisher.batch import Batch, BatchState
from hedgepub._publisher.bulk import CoreBulk
from hedgepub._publisher.closing import ClientState, CoreClosing
from hedgepub._publisher.flow_control import FlowController
from hedgepub._publisher.forwarding import CoreForwarding
from hedgepub._publisher.futures import AsyncPublishFuture, BatchFuture, resolve_batch
from hedgepub._publisher.messages import MessagePreparer
from hedgepub._publisher.observer import BatchObserver
from hedgepub._publisher.routes import EndpointRoutes
from hedgepub._publisher.sender import AttemptCounts, BatchSender
from hedgepub._publisher.sequencer import OrderingSequencer
from hedgepub._publisher.stats import PublisherStats, StatsRecorder
from hedgepub._settings import MAX_REQUEST_BYTES, BatchSettings, HedgingSettings, RetrySettings
from hedgepub._transport.grpc import TokenRefresher, Transport

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry

_LOGGER = logging.getLogger("hedgepub")

#: Batches a publisher has in flight at once; later ones wait their turn, in order. Google's front ends
#: serve about 100 concurrent streams per connection, so more would only queue inside the channel, where
#: the wait would count against the batch's deadline and hedge delay (and trigger pointless hedges).
MAX_BATCHES_IN_FLIGHT = 100


class _PublisherCore(CoreBulk, CoreClosing, CoreForwarding):
    """Batching, ordering keys, flow control, hedging and stats for one publisher, on one event loop.

    ``add`` may be called from any thread; everything else runs on the core's loop.
    """

    def __init__(
        self,
        *,
        hedging: HedgingSettings | None,
        budget: HedgingBudget,
        batch_settings: BatchSettings,
        retry: RetrySettings,
        ordering: bool,
        flow: FlowController,
        routes: EndpointRoutes,
        stats_recorder: StatsRecorder,
        sender: BatchSender,
        observer: BatchObserver,
        telemetry: PublisherTelemetry | None,
        clock: Clock,
        sync_futures: bool,
        messages: MessagePreparer,
        id_prefix: str,
        credentials: Any,
        refresher: TokenRefresher | None = None,
    ) -> None:
        """Wire the parts :func:`hedgepub._publisher.builder.build_core` made (it checks the settings).

        ``messages`` checks and sizes each message on its way in; ``sender`` sends sealed batches;
        ``observer`` is told once about every
        finished batch (it counts into ``stats_recorder`` and ``routes``, and reports to ``telemetry``);
        ``credentials`` are those the endpoints' channels use, ``refresher`` the one that keeps their
        token fresh.
        """
        self.hedging = hedging
        self.budget = budget
        self.batch_settings = batch_settings
        self.retry = retry
        self.ordering = ordering
        self.clock = clock
        self.sync_futures = sync_futures
        self.flow = flow
        self.stats_recorder = stats_recorder
        self._sender = sender
        self._observer = observer
        self._credentials = credentials
        self._refresher = refresher
        self.routes = routes
        self._max_messages = batch_settings.max_messages
        self._max_bytes = min(batch_settings.max_bytes, MAX_REQUEST_BYTES)
        self._max_latency = batch_settings.max_latency
        self._lock = threading.Lock()
        #: Open batches: ``(topic, ordering_key)`` for ordered ones, ``(topic, "", thread id)`` for the
        #: others (one per publishing thread). Changed under ``_lock``; read without it on the hot path.
        self._open: dict[tuple[Any, ...], Batch] = {}
        #: Batches for the loop: opened (to arm their latency timer) or sealed (to send). Appended from any
        #: thread, emptied by :meth:`_drain` on the loop (deque appends and pops are atomic).
        self._events: deque[Batch] = deque()
        self._wakeup_pending = False
        #: Threads opening a batch of their own right now (see :meth:`_fresh_own`).
        self._opening: set[int] = set()
        self._sequencer = OrderingSequencer()
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        #: Batches handed to the engine and not finished yet (a forked child fails their copies).
        self._sending: set[Batch] = set()
        self._send_queue: deque[Batch] = deque()
        self.state = ClientState.OPEN
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._id_prefix = id_prefix
        self.telemetry = telemetry
        self._messages = messages
        #: Whether :meth:`plain_publish` may take messages without attributes or ordering key in one call.
        self.plain = not flow.enabled and messages.idempotency_attribute is None
        self._batch_numbers = itertools.count()
        self._shutdown_task: asyncio.Future[None] | None = None
        #: Why ``publish`` is refused once the state is no longer OPEN.
        self.refusal = "publish() called after shutdown()"
        #: Whether the endpoints' channels are open (see :meth:`_open_routes_before_first_batch`).
        self._routes_open = False
        #: A weak reference to what keeps the sync client alive (see ``PublisherClient._start``): every
        #: batch holds it until it resolves, so that a client nobody references is not shut down while one
        #: of its publishes is pending. ``None`` for the async client.
        self.keepalive: Callable[[], object | None] | None = None

    # ---- binding -------------------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop, thread_id: int) -> None:
        """Attach the core to the loop (and its thread) that will run its batches."""
        self._loop = loop
        self._loop_thread = thread_id

    def bind_running_loop(self) -> asyncio.AbstractEventLoop:
        """Attach to the running loop on first use; refuse use from a second loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self.bind(loop, threading.get_ident())
        elif self._loop is not loop:
            raise RuntimeError("an AsyncPublisherClient must be used from the event loop it started on")
        return loop

    def transport(self) -> Transport:
        """The primary endpoint's transport, opening the channel on first use (on the loop)."""
        return self.routes.transport(0)

    # ---- the hot path: any thread --------------------------------------------------------------------

    def prepare(
        self, topic: str, data: bytes, ordering_key: str, attributes: dict[str, Any]
    ) -> tuple[Any, int, int]:
        """Validate one message; return (raw message or None, message bytes, framed bytes).

        Refuses a publisher that is shutting down first, before flow control could make the caller wait.
        """
        if self.state is not ClientState.OPEN:
            raise RuntimeError(self.refusal)
        return self._messages.prepare(topic, data, ordering_key, attributes)

    def publish_blocking(self, topic: str, data: bytes, ordering_key: str, attributes: dict[str, Any]) -> Any:
        """The sync client's ``publish`` for any message: validate it, wait for flow control (if on) in
        the calling thread, add it; return its future."""
        message, size, framed = self.prepare(topic, data, ordering_key, attributes)
        if self.flow.enabled:
            self.flow.acquire(size, self.flush_soon)
            return self.add_admitted(topic, data, ordering_key, message, size, framed)
        return self.add(topic, data, ordering_key, message, size, framed)

    def sync_publish(self) -> Callable[..., Any]:
        """The sync client's ``publish(topic, data, ordering_key="", **attributes)`` for this core: the
        plain one (:meth:`plain_publish`) if the core is :attr:`plain`, else :meth:`publish_blocking`."""
        slow = self.publish_blocking
        if not self.plain:

            def publish_any(topic: str, data: bytes, ordering_key: str = "", **attributes: Any) -> Any:
                return slow(topic, data, ordering_key, attributes)

            return publish_any
        return self.plain_publish(slow)

    def plain_publish(
        self,
        slow: Callable[[str, bytes, str, dict[str, Any]], Any],
        loop: asyncio.BaseEventLoop | None = None,
    ) -> Callable[..., Any]:
        """``publish(topic, data, ordering_key="", **attributes)`` for a core whose :attr:`plain` is true
        (no flow control, no idempotency keys): the sync client's (``loop`` None), or the async client's on
        ``loop``, a ``BaseEventLoop`` the core is bound to.

        A message of data alone (no attributes, no ordering key) below 16 KiB goes into the publishing
        thread's open batch within this one call: it is ``publish``, ``prepare``, ``add``, ``_append`` and
        ``_put`` in one, with the settings it reads bound once (at about a hundred thousand messages a
        second, each Python call saved is a few percent). Anything else, a message that finds no open
        batch with room, and (async) a call while ``loop`` is not running in this thread, takes
        ``slow(topic, data, ordering_key, attributes)``, having changed nothing.

        The sync client's function is one of its own (:meth:`_plain_sync_publish`), without the async
        client's two checks of ``loop``: a few bytecodes per message, measured in ``publish()``'s CPU.
        """
        if loop is None:
            return self._plain_sync_publish(slow)
        core = self
        client_open, batch_open = ClientState.OPEN, BatchState.OPEN
        max_bytes, max_messages = self._max_bytes, self._max_messages

        def publish(topic: str, data: bytes, ordering_key: str = "", **attributes: Any) -> Any:
            if (
                attributes
                or ordering_key
                or core.state is not client_open
                or type(data) is not bytes
                or type(topic) is not str
                # The async client's loop runs in this thread exactly when its _thread_id is this thread's:
                # a check without the getpid() that asyncio.get_running_loop() makes on every call.
                or loop._thread_id != get_ident()  # type: ignore[attr-defined]
            ):
                return slow(topic, data, ordering_key, attributes)
            # The message's size on the wire (field tag, length, data) and framed in the request: a payload
            # below 16 KiB has a length of one or two bytes, and so has the message in the request.
            length = len(data)
            if length < 0x80:
                if not length:  # empty: the general path refuses it
                    return slow(topic, data, ordering_key, attributes)
                size = length + 2
            elif length < 0x3FF0:
                size = length + 3
            else:
                return slow(topic, data, ordering_key, attributes)
            framed = size + 2 if size < 0x80 else size + 3
            batch = core._open.get((topic, "", get_ident()))
            if batch is None:
                return slow(topic, data, ordering_key, attributes)
            future: Any = None
            lock = batch.lock
            lock.acquire()
            try:
                if batch.state is batch_open and batch.byte_size + framed <= max_bytes:
                    batch.plain.append(data)
                    batch.byte_size += framed
                    future = AsyncPublishFuture(loop=loop)
                    futures = batch.futures
                    futures.append(future)
                    if len(futures) < max_messages and batch.byte_size < max_bytes:
                        return future
                    core._seal_held(batch)
            finally:
                lock.release()
            if future is None:  # sealed meanwhile, or no room: the general path opens the next batch
                return slow(topic, data, ordering_key, attributes)
            if core._wakeup_needed():
                core._wake_loop()
            return future

        return publish

    def _plain_sync_publish(
        self, slow: Callable[[str, bytes, str, dict[str, Any]], Any]
    ) -> Callable[..., Any]:
        """:meth:`plain_publish` for the sync client: the same steps, each future a ``BatchFuture``."""
        core = self
        client_open, batch_open = ClientState.OPEN, BatchState.OPEN
        max_bytes, max_messages = self._max_bytes, self._max_messages

        def publish(topic: str, data: bytes, ordering_key: str = "", **attributes: Any) -> Any:
            if (
                attributes
                or ordering_key
                or core.state is not client_open
                or type(data) is not bytes
                or type(topic) is not str
            ):
                return slow(topic, data, ordering_key, attributes)
            length = len(data)  # sized and framed as in plain_publish
            if length < 0x80:
                if not length:  # empty: the general path refuses it
                    return slow(topic, data, ordering_key, attributes)
                size = length + 2
            elif length < 0x3FF0:
                size = length + 3
            else:
                return slow(topic, data, ordering_key, attributes)
            framed = size + 2 if size < 0x80 else size + 3
            batch = core._open.get((topic, "", get_ident()))
            if batch is None:
                return slow(topic, data, ordering_key, attributes)
            lock = batch.lock
            lock.acquire()
            try:
                if batch.state is not batch_open or batch.byte_size + framed > max_bytes:
                    future = None
                else:
                    batch.plain.append(data)
                    batch.byte_size += framed
                    future = BatchFuture(batch.condition)  # type: ignore[arg-type]  # a sync client's batch has one
                    futures = batch.futures
                    futures.append(future)
                    if len(futures) < max_messages and batch.byte_size < max_bytes:
                        return future
                    core._seal_held(batch)
            finally:
                lock.release()
            if future is None:  # sealed meanwhile, or no room: the general path opens the next batch
                return slow(topic, data, ordering_key, attributes)
            if core._wakeup_needed():
                core._wake_loop()
            return future

        return publish

    def add(self, topic: str, data: bytes, ordering_key: str, message: Any, size: int, framed: int) -> Any:
        """Put one validated message into its open batch and return its future."""
        if not ordering_key:
            # The fast path: this thread's own open batch, found without the publisher's lock.
            batch = self._open.get((topic, "", threading.get_ident()))
            if batch is not None:
                future = self._append(batch, data, message, size, framed)
                if future is not None:
                    return future
        return self._add_slow(topic, data, ordering_key, message, size, framed)

    def _append(self, batch: Batch, data: bytes, message: Any, size: int, framed: int) -> Any:
        """Add the message to ``batch`` if it is open with room, and return its future (``None`` if not).

        Seals the batch when it is full, and hands it to the loop, without the publisher's lock: threads
        that share a client fill their batches in step, and taking that lock for every full batch made
        them queue at it. Never called holding ``_lock``: the order is ``_lock``, then a batch's lock.
        """
        with batch.lock:
            if batch.state is not BatchState.OPEN or batch.byte_size + framed > self._max_bytes:
                return None
            future = self._put(batch, data, message, size, framed)
            full = len(batch.futures) >= self._max_messages or batch.byte_size >= self._max_bytes
            if full:
                self._seal_held(batch)
        if full and self._wakeup_needed():
            self._wake_loop()
        return future

    def _put(self, batch: Batch, data: bytes, message: Any, size: int, framed: int) -> Any:
        """Write the message into ``batch`` and make its future (holding the batch's lock)."""
        if message is None:
            batch.add_data(data)
        else:
            batch.add_message(message)
        batch.byte_size += framed
        batch.flow_bytes += size
        if self.sync_futures:
            future: Any = BatchFuture(batch.condition)  # type: ignore[arg-type]  # sync_futures: it has one
        else:
            future = AsyncPublishFuture(loop=self._loop)  # bound before any publish
        batch.futures.append(future)
        return future

    def _add_slow(
        self, topic: str, data: bytes, ordering_key: str, message: Any, size: int, framed: int
    ) -> Any:
        """:meth:`add` when a batch must be opened (or the message has an ordering key)."""
        if not ordering_key:
            return self._open_own(topic, data, message, size, framed)
        if not self._routes_open:
            self._open_routes_before_first_batch()
        with self._lock:
            if self.state is not ClientState.OPEN:
                raise RuntimeError(self.refusal)
            key = (topic, ordering_key)
            if key in self._sequencer.paused:
                return self._paused_future(ordering_key)
            batch = self._open.get(key)
            if batch is not None and batch.byte_size + framed > self._max_bytes:
                self._seal_locked(batch)
                batch = None
            if batch is None:
                batch = self._new_batch(topic, ordering_key, key)
                self._open[key] = batch
                self._events.append(batch)  # to arm its latency timer
            with batch.lock:
                future = self._put(batch, data, message, size, framed)
            if len(batch.futures) >= self._max_messages or batch.byte_size >= self._max_bytes:
                self._seal_locked(batch)
            schedule = bool(self._events) and self._wakeup_needed()
        if schedule:
            self._wake_loop()
        return future

    def _open_own(self, topic: str, data: bytes, message: Any, size: int, framed: int) -> Any:
        """:meth:`add` when this thread's own batch (no ordering key) is missing or has no room: seal it,
        open the next and put the message in (see :meth:`_fresh_own`); return the message's future."""
        return self._fresh_own(topic, (topic, "", threading.get_ident()), (data, message, size, framed))[1]

    def _fresh_own(
        self, topic: str, key: tuple[Any, ...], first: tuple[bytes, Any, int, int] | None = None
    ) -> tuple[Batch, Any]:
        """Open a new batch of this thread's own for ``topic`` under ``key``, sealing the one it replaces,
        without the publisher's lock (see :meth:`_append`); with ``first`` (data, raw message, size,
        framed size), put that message in it. Return the batch and the message's future (``None``
        without ``first``). Raises ``RuntimeError`` once the publisher no longer accepts messages.

        Only this thread adds a batch under its key, and whoever takes a batch out of ``_open`` does so
        holding that batch's lock after checking that the key still holds it, so no one takes out a
        batch opened here by mistake. Shutdown, which seals what is open, first waits until no thread
        is in here (``_opening``), after refusing new messages. A batch that one message fills goes
        straight to the loop; any other is kept in ``_open`` and queued for the loop to arm its latency
        timer.
        """
        if not self._routes_open:
            self._open_routes_before_first_batch()
        ident = key[2]
        self._opening.add(ident)
        try:
            if self.state is not ClientState.OPEN:
                raise RuntimeError(self.refusal)
            old = self._open.get(key)
            if old is not None:
                with old.lock:
                    self._seal_held(old)
            batch = self._new_batch(topic, "", key)
            future = None
            with batch.lock:
                if first is not None:
                    future = self._put(batch, *first)
                if len(batch.futures) >= self._max_messages or batch.byte_size >= self._max_bytes:
                    self._seal_held(batch)
                else:
                    self._open[key] = batch
                    self._events.append(batch)
        finally:
            self._opening.discard(ident)
        if self._wakeup_needed():
            self._wake_loop()
        return batch, future

    def _open_routes_before_first_batch(self) -> None:
        """The sync client's first batch: open every endpoint's channels now, on the loop, and return once
        they are (a no-op for the async client, whose batches are opened on its loop anyway).

        Not later, when the loop sends the first batch: that may be in the flush at exit
        (``loop_thread._flush_at_exit``), and the first gRPC asyncio channel of a process starts gRPC's
        poller thread, which from Python 3.12 cannot be started at interpreter shutdown (the channel then
        crashes the interpreter). Opened here, the channels exist before the exit; and a client made
        before ``os.fork()`` that never published still has none (see ``PublisherClient``).
        A failure to open is left to the batch, whose send opens them again and fails with the error.
        Never called holding the publisher's lock (the loop may take it while the caller waits).
        """
        if not self.sync_futures or self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:  # a publish from a future's callback
            self._open_routes()
            return
        opened: concurrent.futures.Future[None] = concurrent.futures.Future()

        def open_on_loop() -> None:
            try:
                self._open_routes()
            finally:
                opened.set_result(None)

        loop = self._loop
        try:
            loop.call_soon_threadsafe(open_on_loop)
        except RuntimeError:  # the loop is closed: the publisher is shut down, and publish says so
            return
        while True:
            try:
                return opened.result(timeout=0.1)
            except TimeoutError:
                if not loop.is_running():  # stopped by a shutdown before it ran the call
                    return

    def _open_routes(self) -> None:
        """Open the endpoints' channels (on the loop), once; a failure is the first batch's to report."""
        try:
            self.routes.open_all()
        except Exception:
            _LOGGER.debug("hedgepub: opening the channels before the first batch failed", exc_info=True)
        self._routes_open = True

    def _new_batch(self, topic: str, ordering_key: str, key: tuple[Any, ...]) -> Batch:
        """An empty open batch, to be kept under ``key`` in ``_open``."""
        batch_id = f"{self._id_prefix}-{next(self._batch_numbers)}"
        batch = Batch(topic, ordering_key, batch_id, self.sync_futures, open_key=key, now=self.clock.now)
        if self.keepalive is not None:
            # Alive here: the publishing thread's publish function holds it.
            batch.keepalive = self.keepalive()
        return batch

    def add_admitted(
        self, topic: str, data: bytes, ordering_key: str, message: Any, size: int, framed: int
    ) -> Any:
        """:meth:`add` for a message that flow control has admitted: its room is given back if that fails."""
        try:
            return self.add(topic, data, ordering_key, message, size, framed)
        except BaseException:
            self.flow.release(1, size)
            raise

    def _paused_future(self, ordering_key: str) -> Any:
        error = OrderingKeyPausedError(ordering_key)
        future: Any = (
            concurrent.futures.Future() if self.sync_futures else AsyncPublishFuture(loop=self._loop)
        )  # the loop is bound before any publish
        future.set_exception(error)
        self.stats_recorder.record_failed(1)
        return future

    def _seal_locked(self, batch: Batch) -> None:
        """Seal ``batch`` and hand it to the loop (holding ``_lock``), unless it is sealed already."""
        with batch.lock:
            self._seal_held(batch)

    def _seal_held(self, batch: Batch) -> None:
        """Holding ``batch.lock``: seal it and queue it for the loop unless it is sealed already, then take
        it out of ``_open``.

        Queued under the batch's lock, and before it leaves ``_open``: shutdown seals each batch it finds
        in ``_open`` under that batch's lock and then drains the queue, so a batch sealed by its own thread
        at the same moment is either still in ``_open`` when shutdown looks (and shutdown waits for its
        lock) or gone from it, and then queued already, before shutdown drains. (Taking it out first left
        a moment when it was in neither, and a shutdown that looked then never sent it.)
        """
        if batch.state is BatchState.OPEN:
            batch.move(BatchState.SEALED)
            self._events.append(batch)
        if self._open.get(batch.open_key) is batch:
            self._open.pop(batch.open_key, None)

    def _wakeup_needed(self) -> bool:
        """Whether the caller, who has just queued a batch in ``_events``, must wake the loop (at most one
        wake-up is pending at a time, however many batches wait).

        Safe without a lock because the caller queues before it asks and :meth:`_drain` clears the flag
        before it empties the queue: a batch queued while a drain runs is either taken by that drain or
        finds the flag clear and wakes the loop again. Two callers may both wake it; that costs one
        spare drain.
        """
        if not self._wakeup_pending:
            self._wakeup_pending = True
            return True
        return False

    def _wake_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        if threading.get_ident() == self._loop_thread:
            loop.call_soon(self._drain)
        else:
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nothing can be sent any more
                _LOGGER.debug("publisher loop closed before a wake-up could be delivered")

    def flush_soon(self) -> None:
        """Seal every open batch (from any thread): flow control is about to make a caller wait."""
        with self._lock:
            for batch in list(self._open.values()):
                self._seal_locked(batch)
            schedule = bool(self._events) and self._wakeup_needed()
        if schedule:
            self._wake_loop()

    # ---- on the loop ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        self._wakeup_pending = False  # before emptying the queue: see _wakeup_needed
        events = self._events
        while events:
            batch = events.popleft()
            try:
                if batch.state is BatchState.OPEN:
                    if batch.timer is None:
                        batch.timer = self.clock.call_later(self._max_latency, partial(self._expire, batch))
                elif batch.state is BatchState.SEALED:
                    self._dispatch(batch)
            except BaseException as error:  # never leave this batch's futures pending
                self._fail(batch, PublishError(f"internal error while dispatching a batch: {error!r}"), error)

    def _expire(self, batch: Batch) -> None:
        with self._lock, batch.lock:
            if self._open.get(batch.open_key) is batch:
                self._open.pop(batch.open_key, None)
            if batch.state is not BatchState.OPEN:
                return  # sealed (full) since: it is on its way to the loop already
            batch.move(BatchState.SEALED)
        batch.timer = None
        self._dispatch(batch)

    def _dispatch(self, batch: Batch) -> None:
        timer: TimerHandle | None = batch.timer
        if timer is not None:
            timer.cancel()
            batch.timer = None
        if batch.ordering_key and not self._sequencer.admit(batch):
            return  # waits behind the batch in flight on its key
        self._start(batch)

    def _start(self, batch: Batch) -> None:
        if self._in_flight >= MAX_BATCHES_IN_FLIGHT:
            batch.move(BatchState.QUEUED)
            self._send_queue.append(batch)
            return
        self._in_flight += 1
        batch.move(BatchState.SENDING)
        self._sending.add(batch)
        task = self._loop.create_task(self._send(batch))  # type: ignore[union-attr]  # bound: a batch is sent
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: Batch) -> None:
        try:
            await self._publish(batch)
        finally:
            self._in_flight -= 1
            self._sending.discard(batch)
            if self._send_queue:
                self._start(self._send_queue.popleft())

    async def _publish(self, batch: Batch) -> None:
        # Counted as attempts go, for a batch that shutdown(timeout) cuts off: the engine's outcome is lost.
        counts = AttemptCounts(started=self.clock.now())
        try:
            outcome = await self._sender.send(batch, counts)
        except asyncio.CancelledError:
            error = self.cut_off_error(batch, sent=True)
            try:
                self._observer.batch_finished(batch, counts.cut_off(error, self.clock.now()), None)
            finally:
                self._fail(batch, error, counted=True)
            raise
        except BaseException as error:
            try:
                self._observer.batch_finished(batch, None, error)
            finally:
                internal = PublishError(f"internal error while publishing a batch: {error!r}")
                self._fail(batch, internal, error, counted=True)
            if not isinstance(error, Exception):
                raise
            return
        try:
            self._observer.batch_finished(batch, outcome, None)
        finally:
            if outcome.ok:
                self._succeed(batch, outcome.message_ids)  # type: ignore[arg-type]  # ok: IDs set
            else:
                self._fail(batch, outcome.error, counted=True)  # type: ignore[arg-type]  # not ok: error set

    def _succeed(self, batch: Batch, message_ids: tuple[str, ...]) -> None:
        batch.move(BatchState.DONE)
        try:
            resolve_batch(batch.futures, batch.condition, message_ids=message_ids, segments=batch.segments)
        finally:
            self._release(batch)
            if batch.ordering_key:
                following = self._sequencer.succeeded((batch.topic, batch.ordering_key))
                if following is not None:
                    self._start(following)

    def _fail(
        self, batch: Batch, error: BaseException, cause: BaseException | None = None, *, counted: bool = False
    ) -> None:
        """Resolve every future of ``batch`` with ``error``; pause its ordering key."""
        if batch.state is BatchState.DONE:
            return
        batch.move(BatchState.DONE)
        if cause is not None:
            error.__cause__ = cause
            _LOGGER.error("hedgepub internal error; failing %d messages", len(batch.futures), exc_info=cause)
        if not counted:
            self.stats_recorder.record_failed(len(batch.futures))
        try:
            resolve_batch(batch.futures, batch.condition, error=error, segments=batch.segments)
        finally:
            self._release(batch)
            if batch.ordering_key:
                self._pause((batch.topic, batch.ordering_key))

    def _release(self, batch: Batch) -> None:
        """The batch has resolved: give back its flow-control room, and let its client go (when this was
        the client's last pending batch and nobody else holds it, its finalizer shuts it down)."""
        if self.flow.enabled:
            self.flow.release(len(batch.futures), batch.flow_bytes)
        batch.keepalive = None

    def _pause(self, key: tuple[str, str]) -> None:
        """A batch on ``key`` failed: fail what waits behind it, and refuse the key until resumed."""
        with self._lock:
            waiting = self._sequencer.pause(key)
            open_batch = self._open.pop(key, None)
            if open_batch is not None:
                with open_batch.lock:
                    if open_batch.state is BatchState.OPEN:  # else sealed by its thread meanwhile
                        open_batch.move(BatchState.SEALED)
        if open_batch is not None:
            waiting.append(open_batch)
        for batch in waiting:
            if batch.timer is not None:
                batch.timer.cancel()
                batch.timer = None
            self._fail(batch, OrderingKeyPausedError(key[1]))

    def resume(self, topic: str, ordering_key: str) -> None:
        """Accept messages on a paused ordering key again (any thread)."""
        with self._lock:
            self._sequencer.paused.discard((topic, ordering_key))

    def stats(self) -> PublisherStats:
        """A snapshot of the counters (any thread)."""
        budget = self.budget
        by_topic = budget.tokens_by_topic()
        return self.stats_recorder.snapshot(
            sum(by_topic.values()),
            budget.hedge_delay,
            endpoints=self.routes.snapshot(),
            tokens_by_topic=by_topic,
        )
