"""An asyncio service on a daemon thread with an event loop of its own: :class:`ServiceThread`, what
:class:`~hedgepub.server.LocalServer` and :class:`~hedgepub.proxy.Proxy` run on, for tests, notebooks and
programs without a loop of their own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ServiceThread"]


class ServiceThread:
    """Runs a service, given as the coroutine function that starts it and the one that stops it (with a
    grace period), on a daemon thread and event loop of its own."""

    def __init__(
        self,
        name: str,
        start: Callable[[], Awaitable[object]],
        stop: Callable[[float | None], Awaitable[object]],
    ) -> None:
        self._name = name
        self._start = start
        self._stop = stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (it may be called once)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """Whether the thread is serving."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread and the service; returns once the service has started, raising what stopped
        it from starting (the thread has ended then)."""
        if self._thread is not None:
            raise RuntimeError(f"{self._name} has already been started")
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stopped = asyncio.Event()
            try:
                await self._start()
            except BaseException as error:
                failure.append(error)
                ready.set()
                return
            ready.set()
            await self._stopped.wait()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(main())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    def stop(self, grace: float | None) -> None:
        """Stop the service (``grace`` seconds for what is in flight) and wait for the thread to end."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return

        async def shutdown() -> None:
            try:
                await self._stop(grace)
            finally:
                assert self._stopped is not None
                self._stopped.set()

        with contextlib.suppress(RuntimeError):  # the loop may already be closing
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result()
        thread.join()

    def call(self, coroutine_function: Callable[[], Awaitable[Any]], timeout: float | None = None) -> Any:
        """Run ``coroutine_function()`` on the service's loop and return its result (any thread);
        ``RuntimeError`` when the service is not running."""
        loop = self._loop
        if loop is None or not self.running:
            raise RuntimeError(f"{self._name} is not running")

        async def run() -> Any:
            return await coroutine_function()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)
