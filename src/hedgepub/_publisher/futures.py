"""Futures that resolve a whole batch at once.

The synchronous client hands out :class:`concurrent.futures.Future` objects. A stock ``Future`` costs a
``threading.Condition`` to build and a lock round trip plus ``notify_all`` to resolve: together more than
the rest of ``publish``. :class:`BatchFuture` is a real ``concurrent.futures.Future`` (``result``,
``exception``, ``cancel``, ``add_done_callback``, ``concurrent.futures.wait`` all behave as documented)
whose condition is shared by every message of one batch, and :func:`resolve_batch` resolves all of them
under one acquisition of that condition with one ``notify_all``. Waiters cannot observe a half-resolved
batch: they wake only once the condition is released, when every future of the batch is done.

A future is built for every message published, so building one must cost little: a ``BatchFuture``
sets its condition, state, result and exception (in ``__init__``, so that CPython keeps them in the
object rather than in a dict of its own), and its lists of waiters and done-callbacks are created on
first use; most futures never get a waiter or a callback, so most never get the lists. Every read or
write of those fields in ``concurrent.futures`` happens holding the future's condition, so creating a
list on first use cannot race. A future that gets a list is noted in its batch's
:class:`BatchCondition`, so that resolving a batch visits only those futures for waiters and callbacks,
and never reads a future's ``__dict__`` (which would make CPython build that dict: one more object per
message for the garbage collector to traverse).

Resolving costs two attribute writes per future, under one acquisition of the condition. A finished
future's ``result()`` and ``done()`` read its state without the condition (see :class:`BatchFuture`).

The fast path relies on ``concurrent.futures.Future``'s internal fields, unchanged since Python 3.2;
:data:`FAST_PATH` checks them at import and the code falls back to the public methods otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import _base
from typing import Any, TypeVar

from hedgepub._exceptions import PublishError, PublishManyError

_T = TypeVar("_T")

# The states' values ("" where this Python has none, which turns the fast path off).
_PENDING: str = getattr(_base, "PENDING", "")
_FINISHED: str = getattr(_base, "FINISHED", "")
# Where concurrent.futures logs a done-callback's exception; _resolve_fast runs the callbacks and logs there.
_CALLBACK_LOGGER = logging.getLogger("concurrent.futures")


def _check_fast_path() -> bool:
    probe: concurrent.futures.Future[object] = concurrent.futures.Future()
    return (
        bool(_PENDING)
        and bool(_FINISHED)
        and all(hasattr(probe, name) for name in ("_condition", "_state", "_waiters", "_done_callbacks"))
        and probe._state == _PENDING
        # The condition's own waiters, which resolving reads to skip notify_all when there are none.
        and isinstance(getattr(threading.Condition(), "_waiters", None), collections.deque)
    )


#: Whether the bulk-resolution fast path matches this Python's ``concurrent.futures.Future``.
FAST_PATH = _check_fast_path()


class BatchCondition(threading.Condition):
    """The condition shared by the futures of one batch, and which of them have waiters or callbacks."""

    def __init__(self, describe: Callable[[], str] | None = None) -> None:
        lock = threading.RLock()
        super().__init__(lock)
        #: The condition's own lock, taken directly (C-level ``with``) where ``with condition`` would go
        #: through ``Condition.__enter__``, a Python call.
        self.lock = lock
        #: Says what the batch is doing (queued, attempts, last error), for a future's timeout message.
        self.describe_pending = describe
        #: Futures that got a list of waiters or of done-callbacks (added holding the condition), as the
        #: keys of a dict: a set that keeps their order.
        self.watched: dict[BatchFuture, None] = {}
        #: The done-callbacks of the batch's pending futures, as (future, callback) in the order they were
        #: added (see :meth:`BatchFuture.add_done_callback`); changed holding :attr:`lock`.
        self.callbacks: list[tuple[BatchFuture, Callable[[Any], object]]] = []


class _ListOnFirstUse:
    """A class attribute that, read on an instance, gives it its own new empty list (then found first),
    and notes the instance in its :class:`BatchCondition`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value: list[Any] = []
        # setattr, not instance.__dict__[...]: reading __dict__ would make CPython build one.
        setattr(instance, self.name, value)
        watched = getattr(instance._condition, "watched", None)
        if watched is not None:
            watched[instance] = None
        return value


class BatchFuture(concurrent.futures.Future[Any]):
    """A ``concurrent.futures.Future`` sharing its condition with the rest of its batch."""

    # Created on first use (most futures never get a waiter or a callback).
    _waiters = _ListOnFirstUse()
    _done_callbacks = _ListOnFirstUse()

    if FAST_PATH:  # chosen once here, not on each of the hundreds of thousands of futures a second

        def __init__(self, condition: threading.Condition) -> None:
            self._condition = condition
            # Set here, although resolving writes two of them again: CPython keeps the attributes that
            # __init__ sets in the object itself, and builds a separate dict for one set later, which made
            # resolving a future eight times dearer and gave the collector one more object per message.
            self._state = _PENDING
            self._result = None
            self._exception = None

    else:

        def __init__(self, condition: threading.Condition) -> None:
            super().__init__()

    # A finished future never changes again, and its result and exception are written before its state
    # (under the condition, see _resolve_fast): once the state reads FINISHED they can be read without
    # the condition, which ``Future`` would take (a Python-level ``Condition.__enter__``) on every call.
    def result(self, timeout: float | None = None) -> Any:
        """The message ID; see ``concurrent.futures.Future.result``. A ``TimeoutError`` says what the
        message's batch is doing: queued, or its attempts so far and the last error."""
        if self._state is _FINISHED and self._exception is None:
            return self._result
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise concurrent.futures.TimeoutError(self._pending_text(timeout)) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """See ``concurrent.futures.Future.exception``; a ``TimeoutError`` says what is pending, as
        :meth:`result`'s does."""
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise concurrent.futures.TimeoutError(self._pending_text(timeout)) from None

    def _pending_text(self, timeout: float | None) -> str:
        describe = getattr(self._condition, "describe_pending", None)
        pending = describe() if callable(describe) else "batch is still pending"
        return f"the message was not published within {timeout:g} s: its {pending}"

    def done(self) -> bool:
        """See ``concurrent.futures.Future.done``."""
        return self._state is _FINISHED or super().done()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """See ``concurrent.futures.Future.add_done_callback``: ``fn(future)`` runs once the future is done
        (at once, in this thread, if it is done already), once; an exception it raises is logged.

        A pending future's callback is kept in its batch's :class:`BatchCondition` (one list per batch,
        one tuple per callback) rather than in a list of the future's own, and resolving the batch runs
        them all, in the order they were added: a callback per message, as the official samples publish,
        costs one append under the condition's lock here and one call there.
        """
        condition = self._condition
        if FAST_PATH and type(condition) is BatchCondition:
            with condition.lock:
                if self._state is _PENDING:
                    condition.callbacks.append((self, fn))
                    return
            _run_callback(fn, self)  # done already (or cancelled), as Future runs it
            return
        super().add_done_callback(fn)

    def cancel(self) -> bool:
        """See ``concurrent.futures.Future.cancel``; the callbacks added run once, here."""
        cancelled = super().cancel()
        condition = self._condition
        if cancelled and FAST_PATH and type(condition) is BatchCondition:
            with condition.lock:
                mine = [fn for future, fn in condition.callbacks if future is self]
                if mine:
                    condition.callbacks = [pair for pair in condition.callbacks if pair[0] is not self]
            for fn in mine:
                _run_callback(fn, self)
        return cancelled

    def _run_done_callbacks(self) -> None:
        # What Future.set_result does after resolving, done here rather than through Future's private
        # _invoke_callbacks: each callback once, with this future; an exception is logged, not raised.
        for callback in self._done_callbacks:
            try:
                callback(self)
            except Exception:
                _CALLBACK_LOGGER.exception("exception calling callback for %r", self)


def _run_callback(fn: Callable[[Any], object], future: Any) -> None:
    """Call one done-callback as ``concurrent.futures`` does: an exception is logged, not raised."""
    try:
        fn(future)
    except Exception:
        _CALLBACK_LOGGER.exception("exception calling callback for %r", future)


class AsyncPublishFuture(asyncio.Future[_T], Coroutine[Any, Any, _T]):
    """What ``AsyncPublisherClient.publish`` returns: the message's asyncio future, which is a coroutine
    too.

    ``await`` it, pass it to ``asyncio.gather`` or ``asyncio.wait`` (which take it as it is: no task per
    message), or to ``asyncio.create_task``, a ``TaskGroup`` or ``asyncio.run``, which want a coroutine
    and drive it through :meth:`send` as they would drive ``publish``'s coroutine: the task ends with
    the future's result. A coroutine of ``publish`` cost a task per message in ``gather``, and creating,
    scheduling and stepping it was most of an asyncio publish's time.
    """

    __slots__ = ()

    def send(self, value: Any) -> Any:
        """Drive the future as a coroutine: yield it while it is pending, then end with its result (or
        raise its exception)."""
        if not self.done():
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        """Raise the exception thrown in (a task that was cancelled while it waited)."""
        if val is None:
            val = typ() if isinstance(typ, type) else typ
        if tb is not None:
            val = val.with_traceback(tb)
        raise val

    def close(self) -> None:
        """Nothing to close: the message is published whether or not anyone waits."""


class _Bulk:
    """What stands in a batch's list of futures for a message of a ``publish_many`` call: always done, so
    that resolving the batch's futures passes over it; its outcome goes to the call's :class:`ManyResult`
    through the batch's segments instead."""

    __slots__ = ("__weakref__", "_condition")

    _state = _FINISHED

    def done(self) -> bool:
        return True


#: The one stand-in (see :class:`_Bulk`): a ``publish_many`` message costs one list entry in its batch.
BULK = _Bulk()


class ManyResult:
    """The outcome of one ``publish_many`` call, message by message, and the one future that gives it.

    Batches carry a call's messages as runs ("segments": where in the batch, how many, where in the call);
    each run is resolved at once (:meth:`resolved`, :meth:`failed`, on the loop or, for messages refused
    before they went in, on the caller's thread). Once every message has its outcome the future gets the
    message IDs in order, or :class:`~hedgepub.PublishManyError` if any failed.
    """

    __slots__ = ("_count", "_errors", "_lock", "_remaining", "future", "message_ids")

    def __init__(self, future: Any, count: int) -> None:
        #: ``concurrent.futures.Future`` (sync client) or an asyncio future (resolved on its loop).
        self.future = future
        #: The call's message IDs so far (``None`` where not yet, or failed); made with the first run
        #: that does not cover the whole call (a call published in one run gets that run's IDs as a list).
        self.message_ids: list[str | None] | None = None
        self._count = count
        self._errors: dict[int, BaseException] = {}
        self._remaining = count
        self._lock = threading.Lock()
        if not count:
            self._finish()

    def _ids(self) -> list[str | None]:
        ids = self.message_ids
        if ids is None:
            ids = self.message_ids = [None] * self._count
        return ids

    def resolved(self, offset: int, message_ids: Sequence[str]) -> None:
        """Messages ``offset`` ... ``offset + len(message_ids) - 1`` of the call were published."""
        count = len(message_ids)
        with self._lock:
            if count == self._count:  # the whole call in one run (the usual case): one copy, no pass
                self.message_ids = list(message_ids)
            else:
                self._ids()[offset : offset + count] = message_ids
            self._remaining -= count
            finished = not self._remaining
        if finished:
            self._finish()

    def failed(self, offset: int, count: int, error: BaseException) -> None:
        """Messages ``offset`` ... ``offset + count - 1`` of the call failed with ``error``."""
        with self._lock:
            self._ids()
            self._errors.update(dict.fromkeys(range(offset, offset + count), error))
            self._remaining -= count
            finished = not self._remaining
        if finished:
            self._finish()

    def one_done(self, index: int) -> Callable[[Any], None]:
        """A done-callback for the future of message ``index`` published on its own."""

        def done(future: Any) -> None:
            error = None if future.cancelled() else future.exception()
            if future.cancelled():
                error = PublishError("the message's future was cancelled")
            if error is None:
                self.resolved(index, (future.result(),))
            else:
                self.failed(index, 1, error)

        return done

    def _finish(self) -> None:
        future = self.future
        if future.done():  # cancelled by its owner: the messages were published all the same
            return
        message_ids = self._ids()
        if self._errors:
            future.set_exception(PublishManyError(message_ids, dict(sorted(self._errors.items()))))
        else:
            future.set_result(message_ids)


def resolve_segments(
    segments: Sequence[tuple[ManyResult, int, int, int]],
    message_ids: Sequence[str] | None = None,
    error: BaseException | None = None,
) -> None:
    """Give each ``publish_many`` run of a batch (result, where in the batch, how many, where in the
    call) its message IDs, or ``error``."""
    for result, start, count, offset in segments:
        if error is None:
            assert message_ids is not None
            whole = start == 0 and count == len(message_ids)  # the batch is this run: no slice
            result.resolved(offset, message_ids if whole else message_ids[start : start + count])
        else:
            result.failed(offset, count, error)


def resolve_batch(
    futures: Sequence[Any],
    condition: threading.Condition | None,
    message_ids: Sequence[str] | None = None,
    error: BaseException | None = None,
    segments: Sequence[tuple[ManyResult, int, int, int]] | None = None,
) -> None:
    """Resolve every future of a batch: result ``message_ids[i]``, or ``error`` for all; and its
    ``publish_many`` runs (``segments``, see :func:`resolve_segments`), after the futures.

    Futures already done (cancelled by their owner) are left alone. Asyncio futures must be resolved on
    their loop's thread, which is where the publisher core calls this.
    """
    if segments:
        try:
            # A batch of publish_many runs alone holds no future of its own (only BULK entries, always
            # done): nothing to pass over message by message.
            if sum(segment[2] for segment in segments) != len(futures):
                _resolve_futures(futures, condition, message_ids, error)
        finally:
            resolve_segments(segments, message_ids, error)
        return
    _resolve_futures(futures, condition, message_ids, error)


def _resolve_futures(
    futures: Sequence[Any],
    condition: threading.Condition | None,
    message_ids: Sequence[str] | None,
    error: BaseException | None,
) -> None:
    if not futures:
        return
    # One result per future: its message ID, or None beside the error that all of them share.
    if error is None:
        assert message_ids is not None
        results: Iterable[str | None] = message_ids
    else:
        results = itertools.repeat(None, len(futures))
    if FAST_PATH and isinstance(condition, BatchCondition):
        # A batch whose condition is a BatchCondition made its futures BatchFutures (or BULK).
        _resolve_fast(futures, condition, results, error)
        return
    for future, message_id in zip(futures, results, strict=True):
        if future.done():
            continue
        try:
            if error is None:
                future.set_result(message_id)
            else:
                future.set_exception(error)
        except concurrent.futures.InvalidStateError:  # cancelled by another thread since done() said no
            pass


def _resolve_fast(
    futures: Sequence[BatchFuture],
    condition: BatchCondition,
    results: Iterable[str | None],
    error: BaseException | None,
) -> None:
    pending, finished = _PENDING, _FINISHED
    with_callbacks = []
    with condition.lock:
        # Only the futures noted in the condition have waiters or callbacks: those still pending now are
        # the ones this call resolves (a future cancelled by its owner is left alone).
        watched = [future for future in condition.watched if future._state is pending]
        if error is None:
            for future, message_id in zip(futures, results, strict=True):
                if future._state is pending:
                    future._result = message_id
                    future._state = finished
        else:
            for future in futures:
                if future._state is pending:
                    future._exception = error
                    future._state = finished
        for future in watched:
            for waiter in future._waiters:
                if error is None:
                    waiter.add_result(future)
                else:
                    waiter.add_exception(future)
            if future._done_callbacks:
                with_callbacks.append(future)
        callbacks = condition.callbacks
        if callbacks:
            # Those of futures this call resolved; a future cancelled meanwhile runs its own (cancel).
            condition.callbacks = [pair for pair in callbacks if pair[0]._state is not finished]
        if condition._waiters:  # type: ignore[attr-defined]  # most batches have none: no notify_all
            condition.notify_all()
    # Callbacks run outside the condition, as Future.set_result runs them.
    for future in with_callbacks:
        future._run_done_callbacks()
    if callbacks:
        # _run_callback's body, inline: one Python call less per callback (one per message, as the
        # official samples publish).
        for future, fn in callbacks:
            if future._state is finished:
                try:
                    fn(future)
                except Exception:
                    _CALLBACK_LOGGER.exception("exception calling callback for %r", future)
