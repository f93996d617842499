"""The publisher's core, :class:`_PublisherCore`: batching, ordering keys, flow control and hedging.

There is one implementation of batching, ordering keys, flow control and hedging: :class:`_PublisherCore`,
which runs on one asyncio event loop. The clients of :mod:`hedgepub._publisher.client` build it:
``AsyncPublisherClient`` uses it on the caller's loop; ``PublisherClient`` runs it on a private event-loop
thread (:mod:`hedgepub._publisher.loop_thread`) and is safe to call from any thread.

The hot path is built for throughput:

* ``publish`` validates, then adds the message straight into the raw ``PublishRequest`` of the open batch
  (no proto-plus, no copy, no task per message), under that batch's own lock;
* threads do not wait for each other: messages without an ordering key go into an open batch of the
  publishing thread's own (per topic), found, filled, sealed and replaced without the publisher's lock
  (each batch has its own), so eight threads sharing one client publish as fast as one. Messages with an
  ordering key share one batch per key whatever the thread, opened under the publisher's lock, so that a
  message published after another (in any thread) is never sent before it;
* batches sealed or opened by another thread are handed to the loop through one queue (a deque), with at
  most one ``call_soon_threadsafe`` wake-up pending at a time however many batches are waiting;
* a batch's futures are resolved together (see :mod:`hedgepub._publisher.futures`).

Each sealed batch becomes one task that runs the Publish RPC through the hedging engine
(:func:`hedgepub._hedging.engine.run_batch`): retries, back-off, deadlines and hedges all come from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hedgepub._clock import Clock, TimerHandle
from hedgepub._exceptions import OrderingKeyPausedError, PublishError, ShutdownTimeoutError
from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import AdaptiveDelayEstimator
from hedgepub._hedging.engine import BatchOutcome, run_batch
from hedgepub._publisher.batch import Batch, BatchState, field_size, request_overhead, varint_size
from hedgepub._publisher.flow_control import FlowController
from hedgepub._publisher.futures import BatchFuture, resolve_batch
from hedgepub._publisher.routes import EndpointRoutes, check_hedge_endpoints
from hedgepub._publisher.stats import PublisherStats, StatsRecorder
from hedgepub._settings import (
    MAX_REQUEST_BYTES,
    BatchSettings,
    FlowControlSettings,
    HedgingSettings,
    RetrySettings,
    adaptive_delay_limit,
    check_hedging,
)
from hedgepub._transport.grpc import (
    ChannelTarget,
    GrpcTransport,
    PubsubMessagePb,
    Transport,
    create_channel,
    request_metadata,
    resolve_endpoint,
)

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import BatchTrace, PublisherTelemetry

_LOGGER = logging.getLogger("hedgepub")

#: Batches a publisher has in flight at once; later ones wait their turn, in order. Google's front ends
#: serve about 100 concurrent streams per connection, so more would only queue inside the channel, where
#: the wait would count against the batch's deadline and hedge delay (and trigger pointless hedges).
MAX_BATCHES_IN_FLIGHT = 100


class ClientState(enum.Enum):
    """Where a publisher is in its life."""

    #: Accepting messages.
    OPEN = "open"
    #: ``shutdown`` has begun: new messages are refused, pending batches are being flushed.
    CLOSING = "closing"
    #: Every future has resolved and the channel is closed.
    CLOSED = "closed"


def _idempotency_attribute(value: object) -> str | None:
    """The attribute name to stamp keys in: ``True`` for the default, a name, or ``None`` (off)."""
    if value is False or value is None:
        return None
    if value is True:
        from hedgepub.dedup import IDEMPOTENCY_ATTRIBUTE

        return IDEMPOTENCY_ATTRIBUTE
    if not isinstance(value, str):
        raise TypeError(
            f"idempotency_attribute must be True, False or an attribute name; got {type(value).__name__}"
        )
    if not value or len(value.encode("utf-8")) > 256 or value.startswith("goog"):
        raise ValueError(
            f"idempotency_attribute {value!r} is not a usable attribute key: 1 to 256 bytes, "
            "not starting with 'goog'"
        )
    return value


def _telemetry(core: _PublisherCore, tracer_provider: Any, meter_provider: Any) -> PublisherTelemetry:
    """The OpenTelemetry instrumentation of ``core`` (imported only when a client asks for it)."""
    try:
        from hedgepub._publisher.telemetry import PublisherTelemetry
    except ImportError as error:
        raise ImportError(
            f"enable_open_telemetry=True needs the OpenTelemetry API ({error}): pip install 'hedgepub[otel]'"
        ) from error
    return PublisherTelemetry(
        core._id_prefix,
        weakref.WeakMethod(core.gauge_values),
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )


def _check_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attribute values must be text; UTF-8 ``bytes`` are decoded, as the official client does."""
    for name, value in attributes.items():
        if type(value) is str:
            continue
        if isinstance(value, str):
            continue
        if isinstance(value, (bytes, bytearray)):
            try:
                attributes[name] = bytes(value).decode("utf-8")
                continue
            except UnicodeDecodeError:
                pass
        if name in ("retry", "timeout"):
            raise TypeError(
                f"publish(..., {name}=...) per message is the official client's argument; hedgepub sets it "
                "for the whole client: pass retry_settings=hedgepub.RetrySettings(...) (or "
                "publisher_options=...) to PublisherClient instead"
            )
        raise TypeError(
            f"attribute {name!r} must be a str (text); got {type(value).__name__}. "
            "All attributes published to Pub/Sub must be text strings."
        )
    return attributes


class _KeyQueue:
    """The batches of one ordering key: at most one in flight, the rest waiting in order."""

    __slots__ = ("in_flight", "waiting")

    def __init__(self) -> None:
        self.in_flight = False
        self.waiting: deque[Batch] = deque()


class _PublisherCore:
    """Batching, ordering keys, flow control, hedging and stats for one publisher, on one event loop.

    ``add`` may be called from any thread; everything else runs on the core's loop.
    """

    def __init__(
        self,
        *,
        hedging_settings: HedgingSettings | None,
        batch_settings: BatchSettings,
        retry_settings: RetrySettings,
        flow_control: FlowControlSettings,
        enable_message_ordering: bool,
        endpoint: str | None,
        credentials: Any,
        transport: Transport | None,
        clock: Clock,
        sync_futures: bool,
        hedge_endpoints: Sequence[str] | None = None,
        hedge_transports: Sequence[Transport] | None = None,
        idempotency_attribute: bool | str = False,
        root_certificates: bytes | None = None,
        enable_open_telemetry: bool = False,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        for name, value, kind in (
            ("batch_settings", batch_settings, BatchSettings),
            ("retry_settings", retry_settings, RetrySettings),
            ("flow_control", flow_control, FlowControlSettings),
        ):
            if not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__}; got {type(value).__name__} {value!r}")
        if hedging_settings is not None and not isinstance(hedging_settings, HedgingSettings):
            raise TypeError(
                f"hedging_settings must be a HedgingSettings or None; got {type(hedging_settings).__name__}"
            )
        check_hedging(hedging_settings, retry_settings, bool(enable_message_ordering))
        self.hedging = hedging_settings
        self.batch_settings = batch_settings
        self.retry = retry_settings
        self.ordering = bool(enable_message_ordering)
        self.bucket = TokenBucket.from_settings(hedging_settings) if hedging_settings is not None else None
        self.delay_source: AdaptiveDelayEstimator | None = None
        if hedging_settings is not None and hedging_settings.adaptive_delay is not None:
            self.delay_source = AdaptiveDelayEstimator(
                hedging_settings.adaptive_delay,
                fallback=hedging_settings.hedge_delay,
                limit=adaptive_delay_limit(retry_settings),
            )
        self.clock = clock
        self.sync_futures = sync_futures
        self.flow = FlowController(flow_control, on_block=self._flush_soon)
        self.stats_recorder = StatsRecorder()
        self._credentials = credentials
        if root_certificates is not None and not isinstance(root_certificates, bytes):
            raise TypeError(
                "root_certificates must be PEM bytes (Path(...).read_bytes()); got "
                f"{type(root_certificates).__name__}"
            )
        self._root_certificates = root_certificates
        self.routes = self._routes(
            endpoint,
            transport,
            check_hedge_endpoints(hedge_endpoints, hedging_settings is not None),
            hedge_transports,
        )
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
        #: Threads opening a batch of their own right now (see :meth:`_open_own`).
        self._opening: set[int] = set()
        self._paused: set[tuple[str, str]] = set()
        self._keys: dict[tuple[str, str], _KeyQueue] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        #: Batches handed to the engine and not finished yet (a forked child fails their copies).
        self._sending: set[Batch] = set()
        self._send_queue: deque[Batch] = deque()
        self._overheads: dict[str, int] = {}
        self.state = ClientState.OPEN
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._id_prefix = uuid.uuid4().hex[:16]
        if not enable_open_telemetry and (tracer_provider is not None or meter_provider is not None):
            raise ValueError("tracer_provider and meter_provider need enable_open_telemetry=True")
        self.telemetry = _telemetry(self, tracer_provider, meter_provider) if enable_open_telemetry else None
        self.idempotency_attribute = _idempotency_attribute(idempotency_attribute)
        # 128 random bits per publisher, then a count: unique across publishers and processes.
        self._key_prefix = uuid.uuid4().hex
        self._message_keys = itertools.count()
        self._batch_numbers = itertools.count()
        self._shutdown_task: asyncio.Future[None] | None = None
        #: Why ``publish`` is refused once the state is no longer OPEN.
        self.refusal = "publish() called after shutdown()"

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

    def _routes(
        self,
        endpoint: str | None,
        transport: Transport | None,
        hedge_endpoints: tuple[str, ...],
        hedge_transports: Sequence[Transport] | None,
    ) -> EndpointRoutes:
        """The primary endpoint, then the hedge endpoints, each connected on first use.

        ``transport`` and ``hedge_transports`` are ready-made transports (tests), labelled ``primary``
        and ``hedge-endpoint-N``; endpoints given by name are labelled with their ``host:port``.
        """
        if hedge_transports is not None and hedge_endpoints:
            raise ValueError("pass hedge_endpoints or hedge_transports, not both")
        if hedge_transports and self.hedging is None:
            raise ValueError("hedge_transports needs hedging: pass hedging_settings=HedgingSettings(...)")
        primary = None if transport is not None else resolve_endpoint(endpoint, credentials=self._credentials)
        targets = [resolve_endpoint(name, credentials=self._credentials) for name in hedge_endpoints]
        if self._credentials is None and any(target.secure for target in (primary, *targets) if target):
            # Find Application Default Credentials now, so that a missing setup fails at construction.
            import google.auth

            from hedgepub._transport.grpc import SCOPES

            self._credentials, _project = google.auth.default(scopes=SCOPES)

        def connect(target: ChannelTarget) -> Callable[[], Transport]:
            def open_channel() -> Transport:
                channel = create_channel(target, self._credentials, root_certificates=self._root_certificates)
                # Connect (TCP, TLS) now: a hedge endpoint is first needed in a stall, the worst moment
                # to pay for a handshake.
                channel.get_state(try_to_connect=True)
                return GrpcTransport(channel)

            return open_channel

        def ready(made: Transport) -> Callable[[], Transport]:
            return lambda: made

        labels = ["primary" if primary is None else primary.target]
        connects = [ready(transport) if transport is not None else connect(primary)]  # type: ignore[arg-type]
        for number, made in enumerate(hedge_transports or (), start=1):
            labels.append(f"hedge-endpoint-{number}")
            connects.append(ready(made))
        for target in targets:
            labels.append(target.target)
            connects.append(connect(target))
        return EndpointRoutes(labels, connects)

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
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes; got {type(data).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str; got {type(topic).__name__}")
        if ordering_key:
            if not isinstance(ordering_key, str):
                raise TypeError(f"ordering_key must be a str; got {type(ordering_key).__name__}")
            if not self.ordering:
                raise ValueError(
                    "ordering_key given but message ordering is not enabled: construct the publisher "
                    "with enable_message_ordering=True"
                )
        stamp = self.idempotency_attribute
        if stamp is not None and stamp not in attributes:
            # Stamped once, into the request every attempt sends: hedges and retries carry the same key.
            # A key the caller set is kept, so an application that republishes keeps its key too.
            attributes[stamp] = f"{self._key_prefix}-{next(self._message_keys)}"
        if attributes or ordering_key:
            message = PubsubMessagePb(
                data=data, attributes=_check_attributes(attributes), ordering_key=ordering_key
            )
            size = message.ByteSize()
        else:
            message = None
            length = len(data)
            size = (2 + length if length < 0x80 else 1 + varint_size(length) + length) if length else 0
        framed = 2 + size if size < 0x80 else field_size(size)
        overhead = self._overheads.get(topic)
        if overhead is None:
            overhead = self._overheads.setdefault(topic, request_overhead(topic))
        if overhead + framed > MAX_REQUEST_BYTES:
            raise ValueError(
                f"the message is {size} bytes; with its topic it cannot fit a Publish request of at most "
                f"{MAX_REQUEST_BYTES} bytes"
            )
        return message, size, framed

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
            batch.add_message(data=data)
        else:
            batch.append_message(message)
        batch.byte_size += framed
        batch.flow_bytes += size
        if self.sync_futures:
            future: Any = BatchFuture(batch.condition)  # type: ignore[arg-type]
        else:
            future = self._loop.create_future()  # type: ignore[union-attr]
        batch.futures.append(future)
        return future

    def _add_slow(
        self, topic: str, data: bytes, ordering_key: str, message: Any, size: int, framed: int
    ) -> Any:
        """:meth:`add` when a batch must be opened (or the message has an ordering key)."""
        if not ordering_key:
            return self._open_own(topic, data, message, size, framed)
        with self._lock:
            if self.state is not ClientState.OPEN:
                raise RuntimeError(self.refusal)
            key = (topic, ordering_key)
            if key in self._paused:
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
        open the next and put the message in, without the publisher's lock (see :meth:`_append`).

        Only this thread adds a batch under its key, and whoever takes a batch out of ``_open`` does so
        holding that batch's lock after checking that the key still holds it, so no one takes out a
        batch opened here by mistake. Shutdown, which seals what is open, first waits until no thread
        is in here (``_opening``), after refusing new messages.
        """
        ident = threading.get_ident()
        key = (topic, "", ident)
        self._opening.add(ident)
        try:
            if self.state is not ClientState.OPEN:
                raise RuntimeError(self.refusal)
            old = self._open.get(key)
            if old is not None:
                with old.lock:
                    self._seal_held(old)
            batch = self._new_batch(topic, "", key)
            with batch.lock:
                future = self._put(batch, data, message, size, framed)
                if len(batch.futures) >= self._max_messages or batch.byte_size >= self._max_bytes:
                    self._seal_held(batch)  # full with one message: straight to the loop
                else:
                    self._open[key] = batch
                    self._events.append(batch)  # to arm its latency timer
        finally:
            self._opening.discard(ident)
        if self._wakeup_needed():
            self._wake_loop()
        return future

    def _new_batch(self, topic: str, ordering_key: str, key: tuple[Any, ...]) -> Batch:
        """An empty open batch, to be kept under ``key`` in ``_open``."""
        batch_id = f"{self._id_prefix}-{next(self._batch_numbers)}"
        return Batch(topic, ordering_key, batch_id, self.sync_futures, open_key=key)

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
        future: Any = concurrent.futures.Future() if self.sync_futures else self._loop.create_future()  # type: ignore[union-attr]
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
            batch.state = BatchState.SEALED
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

    def _flush_soon(self) -> None:
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
                        batch.timer = self.clock.call_later(
                            self._max_latency, lambda b=batch: self._expire(b)
                        )
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
            batch.state = BatchState.SEALED
        batch.timer = None
        self._dispatch(batch)

    def _dispatch(self, batch: Batch) -> None:
        timer: TimerHandle | None = batch.timer
        if timer is not None:
            timer.cancel()
            batch.timer = None
        if batch.ordering_key:
            key = (batch.topic, batch.ordering_key)
            queue = self._keys.get(key)
            if queue is None:
                queue = self._keys[key] = _KeyQueue()
            if queue.in_flight:
                batch.state = BatchState.QUEUED
                queue.waiting.append(batch)
                return
            queue.in_flight = True
        self._start(batch)

    def _start(self, batch: Batch) -> None:
        if self._in_flight >= MAX_BATCHES_IN_FLIGHT:
            batch.state = BatchState.QUEUED
            self._send_queue.append(batch)
            return
        self._in_flight += 1
        batch.state = BatchState.SENDING
        self._sending.add(batch)
        task = self._loop.create_task(self._send(batch))  # type: ignore[union-attr]
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
        outcome: BatchOutcome | None = None
        traced: BatchTrace | None = None
        # Counted here too, for a batch that shutdown(timeout) cuts off: the engine's outcome is lost then.
        sent = {"attempts": 0, "hedges": 0}
        started = self.clock.now()
        routes = self.routes
        clock = self.clock
        try:
            routes.open_all()  # every endpoint's channel opens with the first batch, hedge endpoints too
            if self.telemetry is not None:
                traced = self.telemetry.start_batch(batch)
            request = batch.request
            topic = batch.topic
            batch_id = batch.batch_id

            async def attempt(attempt_number: int, timeout: float) -> list[str]:
                sent["attempts"] += 1
                if attempt_number:
                    sent["hedges"] += 1
                # The engine says when; the attempt number says where (see hedgepub._publisher.routes).
                index = routes.index_for(attempt_number)
                recorder = routes.recorder(index)
                sent_at = clock.now()
                try:
                    transport = routes.transport(index)
                    ids = await transport.publish(
                        request, request_metadata(topic, batch_id, attempt_number), timeout
                    )
                except Exception:  # not CancelledError: a loser cancelled by the engine did not fail
                    recorder.failed()
                    raise
                recorder.answered(clock.now() - sent_at)
                return ids

            outcome = await run_batch(
                attempt
                if traced is None
                else traced.wrap(attempt, lambda n: routes.labels[routes.index_for(n)]),
                message_count=len(batch.futures),
                retry=self.retry,
                hedging=self.hedging,
                bucket=self.bucket,
                clock=self.clock,
                delay_source=self.delay_source,
            )
        except asyncio.CancelledError:
            error = ShutdownTimeoutError("shutdown(timeout) ended before the message was published")
            cut_off = BatchOutcome(
                message_ids=None,
                error=error,
                winner_attempt=None,
                attempts_sent=sent["attempts"],
                hedges_sent=sent["hedges"],
                hedges_skipped=0,  # known only to the engine
                latency=self.clock.now() - started,
            )
            try:
                self.stats_recorder.record_batch(len(batch.futures), cut_off)
                routes.record_batch(cut_off.attempts_sent, cut_off.hedges_sent, None)
                if traced is not None:
                    traced.end(cut_off)
            finally:
                self._fail(batch, error, counted=True)
            raise
        except BaseException as error:
            if traced is not None:
                traced.end(None, error)
            self._fail(batch, PublishError(f"internal error while publishing a batch: {error!r}"), error)
            if not isinstance(error, Exception):
                raise
            return
        try:
            self.stats_recorder.record_batch(len(batch.futures), outcome)
            routes.record_batch(outcome.attempts_sent, outcome.hedges_sent, outcome.winner_attempt)
            if traced is not None:
                traced.end(outcome)
        finally:
            if outcome.ok:
                self._succeed(batch, outcome.message_ids)  # type: ignore[arg-type]
            else:
                self._fail(batch, outcome.error, counted=True)  # type: ignore[arg-type]

    def _succeed(self, batch: Batch, message_ids: tuple[str, ...]) -> None:
        batch.state = BatchState.DONE
        try:
            resolve_batch(batch.futures, batch.condition, message_ids=message_ids)
        finally:
            self._release(batch)
            if batch.ordering_key:
                self._next_on_key((batch.topic, batch.ordering_key))

    def _fail(
        self, batch: Batch, error: BaseException, cause: BaseException | None = None, *, counted: bool = False
    ) -> None:
        """Resolve every future of ``batch`` with ``error``; pause its ordering key."""
        if batch.state is BatchState.DONE:
            return
        batch.state = BatchState.DONE
        if cause is not None:
            error.__cause__ = cause
            _LOGGER.error("hedgepub internal error; failing %d messages", len(batch.futures), exc_info=cause)
        if not counted:
            self.stats_recorder.record_failed(len(batch.futures))
        try:
            resolve_batch(batch.futures, batch.condition, error=error)
        finally:
            self._release(batch)
            if batch.ordering_key:
                self._pause((batch.topic, batch.ordering_key))

    def _release(self, batch: Batch) -> None:
        if self.flow.enabled:
            self.flow.release(len(batch.futures), batch.flow_bytes)

    def _next_on_key(self, key: tuple[str, str]) -> None:
        queue = self._keys.get(key)
        if queue is None:
            return
        if queue.waiting:
            self._start(queue.waiting.popleft())
        else:
            queue.in_flight = False
            del self._keys[key]

    def _pause(self, key: tuple[str, str]) -> None:
        """A batch on ``key`` failed: fail what waits behind it, and refuse the key until resumed."""
        with self._lock:
            self._paused.add(key)
            open_batch = self._open.pop(key, None)
            if open_batch is not None:
                with open_batch.lock:
                    open_batch.state = BatchState.SEALED
        queue = self._keys.pop(key, None)
        waiting = list(queue.waiting) if queue is not None else []
        if open_batch is not None:
            waiting.append(open_batch)
        for batch in waiting:
            if batch.timer is not None:
                batch.timer.cancel()
                batch.timer = None
            batch.state = BatchState.QUEUED  # so that _fail below is the only resolution
            self._fail(batch, OrderingKeyPausedError(key[1]))

    def resume(self, topic: str, ordering_key: str) -> None:
        """Accept messages on a paused ordering key again (any thread)."""
        with self._lock:
            self._paused.discard((topic, ordering_key))

    def abandon_after_fork(self, error: PublishError, refusal: str) -> None:
        """In a child process just forked: fail every inherited future and refuse new messages.

        The messages belong to the parent, which publishes them; their copies here can never learn the
        outcome. Only the forking thread exists in the child, so the locks (which a thread that is gone
        may have held at the fork) are replaced rather than taken, and so is each batch's condition.
        """
        self._lock = threading.Lock()
        self.state = ClientState.CLOSED
        self.refusal = refusal
        batches = [*self._open.values(), *self._events, *self._send_queue, *self._sending]
        for queue in self._keys.values():
            batches += queue.waiting
        self._open, self._events, self._send_queue, self._sending, self._keys = (
            {},
            deque(),
            deque(),
            set(),
            {},
        )
        for batch in {id(batch): batch for batch in batches}.values():
            if batch.state is BatchState.DONE:
                continue
            batch.state = BatchState.DONE
            batch.lock = threading.Lock()
            if batch.condition is not None:
                batch.condition = threading.Condition()
                for future in batch.futures:
                    future._condition = batch.condition
            resolve_batch(batch.futures, batch.condition, error=error)

    def gauge_values(self) -> tuple[float, float]:
        """(tokens in the bucket, hedge delay in seconds) now; zeros without hedging (any thread)."""
        if self.hedging is None:
            return 0.0, 0.0
        delay = self.hedging.hedge_delay if self.delay_source is None else self.delay_source.current
        return self.bucket.tokens, delay  # type: ignore[union-attr]

    def stats(self) -> PublisherStats:
        """A snapshot of the counters (any thread)."""
        endpoints = self.routes.snapshot()
        if self.hedging is None:
            return self.stats_recorder.snapshot(0.0, endpoints=endpoints)
        delay = self.hedging.hedge_delay if self.delay_source is None else self.delay_source.current
        return self.stats_recorder.snapshot(self.bucket.tokens, delay, endpoints=endpoints)  # type: ignore[union-attr]

    # ---- shutdown ------------------------------------------------------------------------------------

    async def shutdown(self, timeout: float | None) -> None:
        """Flush everything, wait for every future (at most ``timeout`` seconds), close the channel."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout: float | None) -> None:
        deadline = None if timeout is None else self.clock.now() + max(0.0, timeout)
        with self._lock:
            self.state = ClientState.CLOSING
        while self._opening:  # threads opening a batch of their own: a few microseconds each
            await asyncio.sleep(0)
        with self._lock:
            for batch in list(self._open.values()):
                self._seal_locked(batch)
        self.flow.close()
        self._drain()
        try:
            while self._tasks:
                remaining = None if deadline is None else deadline - self.clock.now()
                if remaining is not None and remaining <= 0:
                    break
                await asyncio.wait(set(self._tasks), timeout=remaining)
            if self._tasks:
                # Queued batches have no task yet: fail them first, then cancel the running ones, whose
                # attempts the engine cancels on the wire.
                waiting, self._send_queue = list(self._send_queue), deque()
                for batch in waiting:
                    self._fail(
                        batch, ShutdownTimeoutError("shutdown(timeout) ended before the message was sent")
                    )
                for queue in list(self._keys.values()):
                    waiting, queue.waiting = list(queue.waiting), deque()
                    for batch in waiting:
                        self._fail(
                            batch, ShutdownTimeoutError("shutdown(timeout) ended before the message was sent")
                        )
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.state = ClientState.CLOSED
            if self.telemetry is not None:
                self.telemetry.close()
            await self.routes.close()
