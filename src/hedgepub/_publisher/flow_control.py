"""Flow control: a cap on messages published but not yet answered, in count and in bytes.

With ``IGNORE`` nothing is counted. With ``ERROR`` a message that would pass a limit raises
:class:`~hedgepub.FlowControlLimitError`. With ``BLOCK`` the caller waits (the synchronous client's
calling thread blocks; the asynchronous client's ``publish`` awaits) until enough earlier messages have
been answered. Waiters are served first come, first served, so a large message is not starved by a
stream of small ones. A message larger than the byte limit could never be admitted, so it raises at once
in ``BLOCK`` mode too, as the official client does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable

from hedgepub._exceptions import FlowControlLimitError
from hedgepub._settings import FlowControlSettings, LimitExceededBehavior


class _AsyncWaiter:
    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _ThreadWaiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def wake(self) -> None:
        self.event.set()


class FlowController:
    """Counts outstanding messages and bytes against :class:`~hedgepub.FlowControlSettings`.

    ``acquire`` (threads) and ``acquire_async`` (the event loop) admit one message; ``release`` gives back
    a resolved batch's share from any thread; ``close`` wakes every waiter with ``RuntimeError``.
    """

    def __init__(self, settings: FlowControlSettings) -> None:
        self.settings = settings
        self.enabled = settings.limit_exceeded_behavior is not LimitExceededBehavior.IGNORE
        self._block = settings.limit_exceeded_behavior is LimitExceededBehavior.BLOCK
        self._lock = threading.Lock()
        self._waiters: collections.deque[_AsyncWaiter | _ThreadWaiter] = collections.deque()
        self._messages = 0
        self._bytes = 0
        self._closed = False

    @property
    def outstanding(self) -> tuple[int, int]:
        """(messages, bytes) admitted and not yet released."""
        return self._messages, self._bytes

    def _fits(self, size: int) -> bool:
        return (
            self._messages + 1 <= self.settings.message_limit
            and self._bytes + size <= self.settings.byte_limit
        )

    def _admit_or_refuse(self, size: int) -> bool:
        """Under the lock: admit at once (True), raise, or say that the caller must wait (False)."""
        if self._closed:
            raise RuntimeError("the publisher has been shut down")
        if not self._waiters and self._fits(size):
            self._messages += 1
            self._bytes += size
            return True
        settings = self.settings
        if not self._block:
            raise FlowControlLimitError(
                f"flow control limits reached: {self._messages} of {settings.message_limit} messages and "
                f"{self._bytes} of {settings.byte_limit} bytes outstanding; a message of {size} bytes "
                "does not fit (limit_exceeded_behavior=ERROR)"
            )
        if size > settings.byte_limit:
            raise FlowControlLimitError(
                f"a message of {size} bytes exceeds the flow control byte_limit ({settings.byte_limit}) "
                "and would block forever"
            )
        return False

    def _try_take(self, waiter: object, size: int) -> bool:
        if self._closed:
            raise RuntimeError("the publisher has been shut down")
        if self._waiters[0] is waiter and self._fits(size):
            self._messages += 1
            self._bytes += size
            return True
        return False

    def _leave(self, waiter: _AsyncWaiter | _ThreadWaiter) -> None:
        with self._lock:
            was_head = bool(self._waiters) and self._waiters[0] is waiter
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if was_head and self._waiters:
                self._waiters[0].wake()

    def acquire(self, size: int, on_block: Callable[[], None] | None = None) -> None:
        """Admit one message of ``size`` bytes from a thread, blocking in ``BLOCK`` mode.

        ``on_block`` is called (outside the lock) each time the caller (re)starts waiting, so that
        messages sitting in open batches are sent now instead of after their batch latency: they are
        what the caller waits for.
        """
        with self._lock:
            if self._admit_or_refuse(size):
                return
            waiter = _ThreadWaiter()
            self._waiters.append(waiter)
        try:
            while True:
                if on_block is not None:
                    on_block()
                waiter.event.wait()
                with self._lock:
                    waiter.event.clear()
                    if self._try_take(waiter, size):
                        return
        finally:
            self._leave(waiter)

    async def acquire_async(self, size: int, on_block: Callable[[], None] | None = None) -> None:
        """Admit one message of ``size`` bytes on the event loop, awaiting in ``BLOCK`` mode (``on_block``
        as for :meth:`acquire`)."""
        with self._lock:
            if self._admit_or_refuse(size):
                return
            waiter = _AsyncWaiter()
            self._waiters.append(waiter)
        try:
            while True:
                if on_block is not None:
                    on_block()
                await waiter.future
                with self._lock:
                    waiter.future = asyncio.get_running_loop().create_future()
                    if self._try_take(waiter, size):
                        return
        finally:
            self._leave(waiter)

    def release(self, messages: int, size: int) -> None:
        """Give back ``messages`` messages and ``size`` bytes; wakes the first waiter."""
        with self._lock:
            self._messages -= messages
            self._bytes -= size
            if self._waiters:
                self._waiters[0].wake()

    def close(self) -> None:
        """Refuse every later acquisition and wake every waiter (they raise ``RuntimeError``)."""
        with self._lock:
            self._closed = True
            for waiter in self._waiters:
                waiter.wake()

    def __repr__(self) -> str:
        return (
            f"FlowController(messages={self._messages}/{self.settings.message_limit}, "
            f"bytes={self._bytes}/{self.settings.byte_limit}, "
            f"behavior={self.settings.limit_exceeded_behavior.name}, waiting={len(self._waiters)})"
        )
