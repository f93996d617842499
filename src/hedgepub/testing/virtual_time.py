"""Run asyncio code on virtual time: the loop's clock jumps to the next timer instead of sleeping.

Every wait in hedgepub goes through a :class:`~hedgepub._clock.Clock`, and the default
:class:`~hedgepub._clock.AsyncioClock` reads ``loop.time()``. On a :class:`VirtualTimeLoop` that time is
virtual: it starts at ``0.0`` and moves only when the loop has nothing ready to run, straight to the
moment of the next scheduled timer. A test of a 600-second deadline therefore takes microseconds of real
time, and the times it observes are exact (``asyncio.sleep(1.0)`` started at ``0.0`` returns at
``loop.time() == 1.0``).

How to use it (any area's tests)::

    from hedgepub.testing.virtual_time import run_virtual, virtual_time

    def test_something() -> None:          # a plain (sync) test
        async def scenario() -> float:
            await asyncio.sleep(30)
            return asyncio.get_running_loop().time()

        assert run_virtual(scenario()) == 30.0

    @virtual_time                          # or: an async test body run on a fresh virtual loop
    async def test_other() -> None:
        ...

``run_virtual`` is like ``asyncio.run``: a fresh loop per call, left-over tasks cancelled at the end. It
also works inside hypothesis tests, where async test functions do not. The ``@virtual_time`` decorator
turns an ``async def`` test into a plain function, so pytest-asyncio leaves it alone and fixtures still
work (they are passed through by keyword).

Limits: virtual time only suits code whose waiting is on timers. Real I/O still happens (the loop's real
selector is polled without blocking before each jump), but time does not wait for it: a socket to a
server thread, or work in an executor, races against timeouts that expire instantly. When nothing is
scheduled at all, the loop blocks for real, so work handed over by other threads (``call_soon_threadsafe``)
still wakes it.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["VirtualTimeLoop", "run_virtual", "virtual_time"]


class _VirtualSelector(selectors.DefaultSelector):
    """The platform selector, except that a wait with a timeout becomes a jump of virtual time."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # asyncio passes timeout 0 when callbacks are ready and None when no timer is scheduled; only a
        # positive timeout means "idle until the next timer", which is the moment to jump.
        if timeout is None or timeout <= 0 or self.loop is None:
            return super().select(timeout)
        ready = super().select(0)
        if ready:
            return ready
        self.loop._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and never waits for a timer.

    Args:
        start: the virtual time the loop starts at, in seconds.
    """

    def __init__(self, start: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = float(start)
        # Our own record of timer deadlines, so a jump lands exactly on a timer's ``when`` instead of on
        # ``now + (when - now)``, which floating point does not always round back to ``when``.
        self._deadlines: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._timer_serial = 0

    def time(self) -> float:
        """The virtual time, in seconds."""
        return self._virtual_now

    # The base's signature, typed loosely: typeshed's uses TypeVarTuple, which needs Python 3.11.
    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """Schedule ``callback`` at virtual time ``when`` (``call_later`` comes through here too)."""
        handle = super().call_at(when, callback, *args, context=context)
        self._timer_serial += 1
        heapq.heappush(self._deadlines, (handle.when(), self._timer_serial, handle))
        return handle

    def advance(self, seconds: float) -> None:
        """Move virtual time forward by ``seconds`` at once, as if the loop had been busy that long."""
        if seconds < 0:
            raise ValueError(f"seconds must not be negative; got {seconds!r}")
        self._virtual_now += seconds

    def _advance(self, timeout: float) -> None:
        deadlines = self._deadlines
        while deadlines and (deadlines[0][2].cancelled() or deadlines[0][0] <= self._virtual_now):
            heapq.heappop(deadlines)
        target = self._virtual_now + timeout
        if deadlines and deadlines[0][0] <= target + 1e-9:
            target = deadlines[0][0]
        self._virtual_now = max(self._virtual_now, target)


def _cancel_left_over_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def run_virtual(coroutine: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``coroutine`` to completion on a fresh :class:`VirtualTimeLoop` and return its result.

    Like ``asyncio.run``: tasks still pending at the end are cancelled, async generators are closed, and
    the loop is closed. The loop is the current event loop while the coroutine runs.
    """
    loop = VirtualTimeLoop(start=start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coroutine)
    finally:
        try:
            _cancel_left_over_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def virtual_time(function: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """Decorate an ``async def`` test so that it runs on a fresh virtual-time loop via :func:`run_virtual`.

    The result is a plain function with the same signature, so pytest still injects fixtures.
    """

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> T:
        return run_virtual(function(*args, **kwargs))

    return run
