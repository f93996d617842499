"""The end of a publisher core's life: :class:`ClientState`, and :class:`CoreClosing`, the part of
:class:`~hedgepub._publisher.core._PublisherCore` that shuts it down (seal what is open, send it, wait for
every future at most the timeout, then fail or cancel the rest and close the channels) and that abandons
its messages in a forked child.

Apart from the hot path (:mod:`hedgepub._publisher.core`), which only reads :attr:`CoreClosing.state`.
The core's state that closing works on is listed on :class:`CoreClosing`; the core sets it up.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from hedgepub._clock import Clock
from hedgepub._exceptions import PublishError, RpcError, ShutdownTimeoutError
from hedgepub._publisher.batch import Batch, BatchState
from hedgepub._publisher.flow_control import FlowController
from hedgepub._publisher.futures import BatchCondition, resolve_batch
from hedgepub._publisher.routes import EndpointRoutes
from hedgepub._publisher.sequencer import OrderingSequencer
from hedgepub._status import StatusCode

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry

__all__ = ["UNREACHABLE_CLOSE_TIMEOUT", "ClientState", "CoreClosing"]

#: The longest ``shutdown()`` (a ``with`` block's end, ``stop()``) waits for messages to an endpoint that
#: no attempt ever reached and whose latest attempts could not connect (a closed port, a wrong address):
#: seconds from the start of the shutdown; then they fail with UNAVAILABLE instead of being retried for
#: the total timeout (ten minutes by default). An endpoint that answered once may be restarting: its
#: messages get the whole flush, as before.
UNREACHABLE_CLOSE_TIMEOUT = 5.0
#: While nothing reached the endpoint yet but no attempt failed to connect either (the first is still
#: connecting), how often a shutdown past the bound looks again.
_RECHECK = 0.25


class ClientState(enum.Enum):
    """Where a publisher is in its life."""

    #: Accepting messages.
    OPEN = "open"
    #: ``shutdown`` has begun: new messages are refused, pending batches are being flushed.
    CLOSING = "closing"
    #: Every future has resolved and the channel is closed.
    CLOSED = "closed"


class CoreClosing:
    """Shutdown and fork abandonment of a publisher core (a base class of ``_PublisherCore``, which sets
    every attribute below in its constructor and provides the three methods named under TYPE_CHECKING)."""

    state: ClientState
    #: Why ``publish`` is refused once the state is no longer OPEN.
    refusal: str
    clock: Clock
    flow: FlowController
    routes: EndpointRoutes
    telemetry: PublisherTelemetry | None
    _lock: threading.Lock
    _open: dict[tuple[Any, ...], Batch]
    _events: deque[Batch]
    _opening: set[int]
    _sequencer: OrderingSequencer
    _tasks: set[asyncio.Task[None]]
    _sending: set[Batch]
    _send_queue: deque[Batch]
    _shutdown_task: asyncio.Future[None] | None
    #: Why the shutdown gave up on its messages while their endpoint was never reached (None: it did not).
    _gave_up: str | None = None

    if TYPE_CHECKING:

        def _seal_locked(self, batch: Batch) -> None: ...

        def _drain(self) -> None: ...

        def _fail(
            self,
            batch: Batch,
            error: BaseException,
            cause: BaseException | None = None,
            *,
            counted: bool = False,
        ) -> None: ...

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
        batches += self._sequencer.forget()
        self._open, self._events, self._send_queue, self._sending = {}, deque(), deque(), set()
        for batch in {id(batch): batch for batch in batches}.values():
            if batch.state is BatchState.DONE:
                continue
            batch.move(BatchState.DONE)
            batch.lock = threading.Lock()
            if batch.condition is not None:
                inherited, batch.condition = batch.condition, BatchCondition()
                batch.condition.callbacks = inherited.callbacks  # they run as the futures fail
                batch.condition.watched = inherited.watched
                for future in batch.futures:
                    future._condition = batch.condition
            resolve_batch(batch.futures, batch.condition, error=error, segments=batch.segments)

    def has_pending(self) -> bool:
        """Whether messages are still waiting for their outcome (any thread; a snapshot)."""
        return bool(self._tasks or self._open or self._send_queue or self._events)

    async def shutdown(self, timeout: float | None) -> None:
        """Flush everything, wait for every future (at most ``timeout`` seconds), close the channel."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout: float | None) -> None:
        started = self.clock.now()
        deadline = None if timeout is None else started + max(0.0, timeout)
        bound = started + UNREACHABLE_CLOSE_TIMEOUT
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
                now = self.clock.now()
                remaining = None if deadline is None else deadline - now
                if not self.routes.ever_reached:
                    if now >= bound and self.routes.primary_unreachable:
                        self._gave_up = (
                            f"never reached {self.routes.recorder(0).description}: shutdown gave up after "
                            f"{UNREACHABLE_CLOSE_TIMEOUT:g} s"
                        )
                        break
                    left = bound - now if now < bound else _RECHECK
                    remaining = left if remaining is None else min(remaining, left)
                if remaining is not None and remaining <= 0:
                    break
                await asyncio.wait(set(self._tasks), timeout=remaining)
            if self._tasks:
                # Queued batches have no task yet: fail them first, then cancel the running ones, whose
                # attempts the engine cancels on the wire.
                waiting, self._send_queue = list(self._send_queue), deque()
                for batch in waiting:
                    self._fail(batch, self.cut_off_error(batch, sent=False))
                for batch in self._sequencer.take_waiting():
                    self._fail(batch, self.cut_off_error(batch, sent=False))
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.state = ClientState.CLOSED
            if self.telemetry is not None:
                self.telemetry.close()
            await self.routes.close()

    def cut_off_error(self, batch: Batch, *, sent: bool) -> PublishError:
        """The error of a message the shutdown ended before it was published (``sent``: its batch had
        attempts out): UNAVAILABLE when it gave up on an endpoint never reached, else
        :class:`~hedgepub.ShutdownTimeoutError`."""
        what = f"its {batch.describe(self.clock.now())}"
        if self._gave_up is not None:
            return RpcError(StatusCode.UNAVAILABLE, f"{self._gave_up}; {what}")
        done = "published" if sent else "sent"
        return ShutdownTimeoutError(f"shutdown(timeout) ended before the message was {done}: {what}")
