"""The private event-loop thread of each :class:`~hedgepub.PublisherClient`, and the flush at exit.

:class:`_LoopThread` runs a client's :class:`~hedgepub._publisher.core._PublisherCore` on an event loop
of its own, in a daemon thread; every one not shut down yet is in ``_OPEN_RUNNERS``, which
:func:`_flush_at_exit` (registered with :mod:`atexit` when this module is imported) shuts down, and which
:func:`forget_open_runners` empties in a forked child.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading

# Imported at run time, not only for the annotations: this loads gRPC, whose own exit hooks must be
# registered before _flush_at_exit is (see there).
from hedgepub._publisher.core import _PublisherCore

_LOGGER = logging.getLogger("hedgepub")

#: The longest an implicit shutdown (at exit, or of a client garbage-collected) waits while the client's
#: primary endpoint cannot be reached: its latest attempts failed without connecting.
UNREACHABLE_EXIT_TIMEOUT = 5.0

#: The loop threads of every sync client not shut down yet, for _flush_at_exit.
_OPEN_RUNNERS: set[_LoopThread] = set()
_OPEN_RUNNERS_LOCK = threading.Lock()


def forget_open_runners() -> list[_LoopThread]:
    """In a child process just forked: the parent's loop threads are gone, so there is nothing of theirs to
    flush at exit (called by the client's at-fork hook, before the clients' own). Returns them: those of
    clients already dropped (kept running by a pending publish) have no client left to abandon them."""
    global _OPEN_RUNNERS_LOCK
    _OPEN_RUNNERS_LOCK = threading.Lock()  # a thread that is gone may have held it
    runners = list(_OPEN_RUNNERS)
    _OPEN_RUNNERS.clear()  # their threads are gone: nothing to flush at exit from the parent's clients
    return runners


class _LoopThread:
    """The private event loop of one :class:`~hedgepub.PublisherClient` and the daemon thread that runs it.

    The thread is a daemon so that a client left open never blocks the interpreter's exit; instead
    :func:`_flush_at_exit` shuts every open one down. Nothing here refers back to the client, so a client
    nobody holds any more is garbage-collected, and its finalizer calls :meth:`release`.
    """

    def __init__(self, core: _PublisherCore, implicit_timeout: float) -> None:
        self.core = core
        #: The ``shutdown`` timeout used when the client's owner never called it (exit, garbage collection).
        self.implicit_timeout = implicit_timeout
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._shutdown: concurrent.futures.Future[None] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hedgepub-publisher", daemon=True)
        self._thread.start()
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(lambda: started.set_result(threading.get_ident()))
        core.bind(self.loop, started.result())
        with _OPEN_RUNNERS_LOCK:
            _OPEN_RUNNERS.add(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def unattended_timeout(self, why: str) -> float:
        """The timeout of a shutdown nobody asked for (``why``: at exit, garbage-collected): the implicit
        one, or :data:`UNREACHABLE_EXIT_TIMEOUT` while the endpoint cannot be reached, said at WARNING."""
        timeout = self.implicit_timeout
        routes = self.core.routes
        if routes.primary_unreachable and timeout > UNREACHABLE_EXIT_TIMEOUT:
            timeout = UNREACHABLE_EXIT_TIMEOUT
            if self.core.has_pending():
                _LOGGER.warning(
                    "hedgepub: a publisher never shut down is flushed %s while its endpoint %s cannot be "
                    "reached: its unpublished messages get at most %g s more",
                    why,
                    routes.recorder(0).description,
                    timeout,
                )
        return timeout

    def begin_close(self, timeout: float | None) -> concurrent.futures.Future[None] | None:
        """Start the core's shutdown (once; later calls get the first one's future), without waiting."""
        with self._lock:
            if self._shutdown is None and not self._stopped:
                self._shutdown = asyncio.run_coroutine_threadsafe(self.core.shutdown(timeout), self.loop)
            return self._shutdown

    def finish_close(self, shutdown: concurrent.futures.Future[None] | None) -> None:
        """Wait for ``shutdown`` to end, then stop the loop and its thread (not from the loop's thread)."""
        try:
            if shutdown is not None:
                shutdown.result()
        finally:
            with self._lock:
                stop, self._stopped = not self._stopped, True
            if stop:
                with _OPEN_RUNNERS_LOCK:
                    _OPEN_RUNNERS.discard(self)
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
                self.loop.close()

    def abandon(self) -> None:
        """In a forked child: the thread is gone; never wait for it, nor use its loop (whose wake-up
        socket is shared with the parent's)."""
        self._lock = threading.Lock()
        self._stopped = True
        self._shutdown = None

    def close(self, timeout: float | None) -> None:
        """Shut the core down, wait for every future, stop the thread. Safe to call more than once."""
        self.finish_close(self.begin_close(timeout))

    def release(self) -> None:
        """The client was garbage-collected without ``shutdown()``: shut down without blocking the caller.

        Whichever thread dropped the client runs this, possibly the loop's own thread (a future's callback
        holding the last reference) or one holding locks, so a separate non-daemon thread waits for the
        flush; the interpreter waits for that thread at exit.
        """
        shutdown = self.begin_close(self.unattended_timeout("as it is garbage-collected"))
        if shutdown is None:
            return
        try:
            closer = threading.Thread(target=self.finish_close, args=(shutdown,), name="hedgepub-closer")
            closer.start()
        except RuntimeError:  # the interpreter is past the point of starting threads
            _LOGGER.debug("could not start a thread to finish a dropped publisher's shutdown")


@atexit.register
def _flush_at_exit() -> None:
    """Publish what every sync client left open still holds before the interpreter exits.

    The shutdowns run side by side, so the exit waits for the slowest client rather than for their sum;
    each is bounded by its implicit timeout (:data:`~hedgepub._publisher.client.IMPLICIT_SHUTDOWN_TIMEOUT`),
    or by :data:`UNREACHABLE_EXIT_TIMEOUT` while its endpoint cannot be reached.
    Registered when this module is imported, after gRPC registered its own exit hooks, so it runs before
    them (hooks run last registered, first run) while channels still work.
    """
    with _OPEN_RUNNERS_LOCK:
        runners = list(_OPEN_RUNNERS)
    shutdowns = [(runner, runner.begin_close(runner.unattended_timeout("at exit"))) for runner in runners]
    for runner, shutdown in shutdowns:
        try:
            runner.finish_close(shutdown)
        except Exception:  # one client's failure must not keep the others from flushing
            _LOGGER.exception("hedgepub: flushing a publisher at exit failed")
