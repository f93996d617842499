"""The one place hedgepub reads time.

Everything that waits or measures (token bucket, batcher, hedging engine, stats) takes a :class:`Clock`,
so tests can run the rules on virtual time. No other module calls ``time.monotonic()`` or
``loop.time()`` directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    """A callback scheduled with :meth:`Clock.call_later`."""

    def cancel(self) -> None:
        """Stop the callback from running, if it has not run yet."""


class Clock(Protocol):
    """Seconds on a monotonic scale, a way to wait, and a way to be called back later."""

    def now(self) -> float:
        """Current time in seconds; only differences between two readings mean anything."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (return at once for zero or less)."""

    def call_later(self, delay: float, callback: Callable[[], object]) -> TimerHandle:
        """Run ``callback`` after ``delay`` seconds; the handle cancels it."""


class AsyncioClock:
    """The real clock: the running event loop's monotonic time.

    Inside a running loop ``now`` is ``loop.time()``, so it agrees with ``call_later`` and with any
    event loop whose time is virtual (as in the test suite). Outside a loop it falls back to
    ``time.monotonic()``, the same scale asyncio's default loop uses.
    """

    def now(self) -> float:
        """Current time in seconds."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Wait on the running loop."""
        await asyncio.sleep(max(0.0, seconds))

    def call_later(self, delay: float, callback: Callable[[], object]) -> TimerHandle:
        """Schedule ``callback`` on the running loop."""
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)

    def __repr__(self) -> str:
        return "AsyncioClock()"


#: The clock every component uses unless it is given another.
DEFAULT_CLOCK: Clock = AsyncioClock()
