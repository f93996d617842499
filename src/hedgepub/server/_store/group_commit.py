"""Group commit: the writes of a SQLite store folded into few transactions, committed by one writer
thread or, when that thread is idle and a commit needs no fsync, by the event loop itself.

Every write an event loop queues during one of its steps is committed together, in one transaction, at
the end of that step ("on the loop"), if the writer thread holds nothing (no write queued to it or being
committed, no checkpoint or vacuum running) and the commit needs no fsync (``synchronous`` OFF or NORMAL,
which sync only at checkpoints) and is small (:data:`_INLINE_MAX_BYTES`). Otherwise the step's writes go
to the writer thread, which takes *everything* queued to it at that moment and commits it in one
transaction. Either way each caller's future resolves only after the commit that holds its change, and
writes commit in the order they were made (none goes on the loop while earlier ones wait for the thread).

Why on the loop: a commit of a Publish is about 100 us of SQLite's work, which the thread handoff (two
wake-ups across threads, each a context switch on a machine whose other core serves the clients) cost
about as much again of CPU and more of latency. What may wait on the disk stays on the thread: WAL
checkpoints (which fsync; with commits on the loop, SQLite's automatic checkpoint is off and the thread
runs one after :data:`_CHECKPOINT_COMMITS` commits or :data:`_CHECKPOINT_BYTES` bytes written on the loop),
commits under ``synchronous=FULL`` or ``EXTRA``, large commits, and giving freed pages back. One operation
that fails does not fail the others folded with it: they are retried each in a transaction of its own.

Why a step's commit waits while other callbacks are ready (for at most :data:`_LINGER_SECONDS`): with a
few Publish calls in flight, a loop step rarely holds more than one of them, and a transaction of one
10 KB batch writes 7 to 8 pages to the WAL (the body's three, and the tables' leaves, the page map and
the header, which every transaction writes again), four in one transaction about 4 each, at two thirds
of the time per batch. The callbacks ready beside a commit are often the next calls' handlers, whose
writes then join it; a loop with nothing else ready commits at once, so a lone write waits for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ON_THREAD", "GroupCommitWriter", "Operation", "Statement"]

#: A write: run inside the writer's transaction, on the writer's connection.
Operation = Callable[[sqlite3.Connection], None]


class Statement:
    """A write that is one SQL statement: alone in a group, it is committed as SQLite commits any
    statement outside a transaction (atomically, with the connection's ``synchronous``), without the
    ``BEGIN`` and ``COMMIT`` around it: each call into SQLite gives up and takes back the interpreter
    lock, which the event loop's thread holds most of the time, so one call costs less than three."""

    __slots__ = ("parameters", "sql")

    def __init__(self, sql: str, parameters: tuple[Any, ...]) -> None:
        self.sql = sql
        self.parameters = parameters

    def __call__(self, connection: sqlite3.Connection) -> None:
        connection.execute(self.sql, self.parameters)


# A queued write, the future its caller awaits, and that caller's loop.
_Item = tuple[Operation, "asyncio.Future[None]", asyncio.AbstractEventLoop]

#: A loop step's writes are committed on the loop only while they are at most this many bytes (as their
#: callers estimate them): a larger commit goes to the writer thread, so that the loop is never held long.
_INLINE_MAX_BYTES = 1024 * 1024
#: The ``size`` of a write whose work is not bounded by its arguments (dropping a holder's backlog, copying
#: one into a snapshot, clearing the file): always committed by the writer thread.
ON_THREAD = _INLINE_MAX_BYTES + 1
#: With commits on the loop, the writer thread checkpoints the WAL after this many of them, or this many
#: bytes written by them, whichever comes first (SQLite's own checkpoint, every 4,096 pages, would fsync
#: on the loop).
_CHECKPOINT_COMMITS = 512
_CHECKPOINT_BYTES = 16 * 1024 * 1024

#: Most operations folded into one transaction, so one commit never grows without bound.
_MAX_GROUP = 512
#: How long a loop's commit may wait for the callbacks ready to run beside it (see the module's docstring).
_LINGER_SECONDS = 0.001
#: Free pages are given back to the file system (incremental vacuum) once they are this share of the file
#: and at least ``_VACUUM_MIN_PAGES``; below that SQLite reuses them for new rows, which is cheaper.
_VACUUM_SHARE = 0.25
_VACUUM_MIN_PAGES = 2048
#: At most this many pages (8 MiB) go back per step, so that one step holds up the writer only briefly.
_VACUUM_STEP_PAGES = 2048
#: Commits between two looks at the free pages.
_VACUUM_CHECK_EVERY = 16


class GroupCommitWriter:
    """The writes of one database: ``connect()`` opens its one connection (when the first write comes),
    used by the writer thread and, with ``on_loop``, by event loops committing their own writes (one at a
    time: whoever commits holds the connection's lock). ``on_loop`` must be false when a commit fsyncs
    (``synchronous`` FULL or EXTRA); the connection then keeps SQLite's automatic checkpoint."""

    def __init__(self, connect: Callable[[], sqlite3.Connection], *, on_loop: bool = False) -> None:
        self._connect = connect
        self._on_loop = on_loop
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._writer_thread: threading.Thread | None = None
        self._closed = False
        self._connection: sqlite3.Connection | None = None
        #: Held by whoever uses the connection (the writer thread, or a loop committing its step's writes).
        self._using = threading.Lock()
        #: Writes handed to the thread and not yet settled (under ``_counting``): while any are, no loop
        #: commits on its own, so that writes commit in the order they were made.
        self._outstanding = 0
        self._counting = threading.Lock()
        #: Each loop's writes of its current step, with their estimated bytes, committed at its end.
        self._steps: dict[asyncio.AbstractEventLoop, tuple[list[_Item], list[int]]] = {}
        #: Commits (and their estimated bytes) on loops since the last checkpoint.
        self._loop_commits = 0
        self._loop_bytes = 0
        self.commits = 0  # transactions committed, for tests and benchmarks of group commit
        self.loop_commits = 0  # of which committed on an event loop, for tests and benchmarks

    def _open(self) -> sqlite3.Connection:
        """The connection (opened the first time; the caller holds ``_using``)."""
        connection = self._connection
        if connection is None:
            connection = self._connection = self._connect()
            if self._on_loop:
                # Checkpoints fsync: the writer thread runs them (see _commit_step), never a loop.
                connection.execute("PRAGMA wal_autocheckpoint=0")
        return connection

    def _start(self) -> None:
        if self._writer_thread is None:
            self._writer_thread = threading.Thread(
                target=self._write_loop, name="hedgepub-sqlite", daemon=True
            )
            self._writer_thread.start()

    def _hand_over(self, items: list[_Item]) -> None:
        """Queue writes to the writer thread (counted until it settles them)."""
        self._start()
        with self._counting:
            self._outstanding += len(items)
        for item in items:
            self._queue.put(item)

    async def write(self, operation: Operation, size: int = 0) -> None:
        """Queue ``operation`` and return once the transaction that ran it committed (or raise its error).

        ``size``: about how many bytes it writes (a Publish's body), which decides whether its loop step's
        writes are small enough to commit on the loop."""
        if self._closed:
            raise RuntimeError("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        item = (operation, future, loop)
        if self._on_loop:
            step = self._steps.get(loop)
            if step is None:
                step = self._steps[loop] = ([], [])
                loop.call_soon(self._commit_step, loop)
            step[0].append(item)
            step[1].append(size)
        else:
            self._hand_over([item])
        # Shielded: a cancelled caller must not make us forget whether its write committed.
        await asyncio.shield(future)

    def _commit_step(self, loop: asyncio.AbstractEventLoop, since: float | None = None) -> None:
        """At the end of a loop step: commit its writes here if the writer thread holds nothing and they
        are small, else hand them to the thread (see the module's docstring). While other callbacks are
        ready to run, the commit waits for them (at most :data:`_LINGER_SECONDS` since it first could
        have run, see the module's docstring), so that the writes they make are folded into it."""
        step = self._steps.get(loop)
        if step is None:
            return  # close() handed them to the thread already
        items, sizes = step
        size = sum(sizes)
        if len(items) < _MAX_GROUP and size < _INLINE_MAX_BYTES and _others_ready(loop):
            now = loop.time()
            if since is None:
                since = now
            if now - since < _LINGER_SECONDS:
                loop.call_soon(self._commit_step, loop, since)
                return
        del self._steps[loop]
        here = False
        if size <= _INLINE_MAX_BYTES and not self._closed:
            with self._counting:
                here = self._outstanding == 0 and self._using.acquire(blocking=False)
        if not here:
            self._hand_over(items)
            return
        try:
            connection = self._open()
            for start in range(0, len(items), _MAX_GROUP):
                self._commit(connection, items[start : start + _MAX_GROUP], on_loop=True)
        except Exception as error:
            # The file could not be opened, or a rollback failed: every write not settled yet fails (a
            # callback's error would only be logged, leaving its callers waiting for good).
            for item in items:
                _resolve(item, error=error, now=True)
            return
        finally:
            self._using.release()
        self._loop_commits += 1
        self._loop_bytes += size
        if self._loop_commits >= _CHECKPOINT_COMMITS or self._loop_bytes >= _CHECKPOINT_BYTES:
            self._loop_commits = self._loop_bytes = 0
            # Not awaited by anyone: the checkpoint's future is settled and dropped.
            self._hand_over([(_checkpoint, loop.create_future(), loop)])

    def _write_loop(self) -> None:
        # Whether free pages may be worth giving back: looked at after every _VACUUM_CHECK_EVERY commits,
        # and whenever the queue has been empty for a quarter second (so an idle server shrinks its file).
        vacuum_due = False
        commits = 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.25) if vacuum_due else self._queue.get()
                except queue.Empty:
                    with self._using:
                        vacuum_due = self._vacuum_step(self._open())
                    continue
                if item is None:
                    return
                group = [item]
                stop = False
                while len(group) < _MAX_GROUP:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    group.append(more)
                # A checkpoint asked for by a loop runs after the group's commit, outside any transaction.
                writes = [entry for entry in group if entry[0] is not _checkpoint]
                with self._using:
                    connection = self._open()
                    if writes:
                        self._commit(connection, writes)
                        commits += 1
                    if len(writes) < len(group):
                        with contextlib.suppress(sqlite3.Error):  # best effort, as SQLite's own
                            _checkpoint(connection)
                        _resolve_all([entry for entry in group if entry[0] is _checkpoint])
                        vacuum_due = self._vacuum_step(connection)
                    elif commits % _VACUUM_CHECK_EVERY == 0:
                        vacuum_due = self._vacuum_step(connection)
                with self._counting:
                    self._outstanding -= len(group)
                if stop:
                    return
        finally:
            with self._using:
                if self._connection is not None:
                    self._connection.close()
                    self._connection = None

    def _vacuum_step(self, connection: sqlite3.Connection) -> bool:
        """Give up to ``_VACUUM_STEP_PAGES`` free pages back to the file system if they are a large share
        of the file; whether more remain to give back.

        Below that share SQLite reuses free pages for new rows, which is cheaper than growing the file
        again. On a file created before ``auto_vacuum`` was set this does nothing (its free pages are
        only reused).
        """
        try:
            (free,) = connection.execute("PRAGMA freelist_count").fetchone()
            (pages,) = connection.execute("PRAGMA page_count").fetchone()
            if free < _VACUUM_MIN_PAGES or free < pages * _VACUUM_SHARE:
                return False
            # Down to a tenth of the file, keeping some free pages for the next rows. executescript, not
            # execute: the sqlite3 module steps a statement without result columns only once, and
            # incremental_vacuum frees one page per step.
            step = min(_VACUUM_STEP_PAGES, free - pages // 10)
            connection.executescript(f"PRAGMA incremental_vacuum({step});")
            return free - step >= pages * _VACUUM_SHARE
        except sqlite3.Error:
            return False  # best effort: a busy or full disk must not stop the writer

    def _commit(self, connection: sqlite3.Connection, group: list[Any], on_loop: bool = False) -> None:
        """Commit ``group`` in one transaction and settle its futures (``on_loop``: on their loop, now)."""
        if len(group) == 1 and isinstance(group[0][0], Statement):
            statement = group[0][0]
            try:
                connection.execute(statement.sql, statement.parameters)
            except Exception as error:
                _resolve(group[0], error=error, now=on_loop)
                return
            self.commits += 1
            self.loop_commits += on_loop
            _resolve_all(group, now=on_loop)
            return
        try:
            connection.execute("BEGIN IMMEDIATE")
            for operation, _, _ in group:
                operation(connection)
            connection.execute("COMMIT")
            self.commits += 1
            self.loop_commits += on_loop
        except Exception as error:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if len(group) == 1:
                _resolve(group[0], error=error, now=on_loop)
                return
            # One bad operation must not fail the others: retry each in a transaction of its own.
            for item in group:
                self._commit(connection, [item], on_loop)
            return
        _resolve_all(group, now=on_loop)

    async def close(self) -> None:
        """Let every queued write commit (a loop step's too), then stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        # Writes of this step not committed yet go to the thread (_commit_step, when it runs, finds none).
        for loop in list(self._steps):
            items, _ = self._steps.pop(loop)
            self._hand_over(items)
        self._start()  # so that the connection, opened on a loop perhaps, is closed by it
        thread = self._writer_thread
        assert thread is not None
        self._queue.put(None)
        await asyncio.get_running_loop().run_in_executor(None, thread.join)


def _others_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether other callbacks are ready to run on ``loop`` (asyncio's own loops keep them in ``_ready``;
    a loop without that attribute is taken to have none, so its commits never wait)."""
    return bool(getattr(loop, "_ready", None))


def _checkpoint(connection: sqlite3.Connection) -> None:
    """Copy the WAL into the database (what SQLite's automatic checkpoint does), on the writer thread,
    outside a transaction (the writer runs it apart from the writes it groups); ``PASSIVE``: readers are
    not waited for (what they still hold is copied by the next one)."""
    connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _resolve_all(group: list[Any], now: bool = False) -> None:
    """Settle a committed group's futures with one wake-up per event loop, not one per write: each
    ``call_soon_threadsafe`` writes to the loop's self-pipe, which cost more than settling the futures.
    ``now``: the caller is the futures' loop (they are settled at once)."""
    if now:
        for _, future, _ in group:
            if not future.done():
                future.set_result(None)
        return
    by_loop: dict[Any, list[asyncio.Future[None]]] = {}
    for _, future, loop in group:
        by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():

        def settle(futures: list[asyncio.Future[None]] = futures) -> None:
            for future in futures:
                if not future.done():
                    future.set_result(None)

        # RuntimeError: the caller's loop is gone, so nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)


def _resolve(item: Any, error: BaseException | None = None, now: bool = False) -> None:
    _, future, loop = item

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    if now:
        settle()
        return
    # RuntimeError: the caller's loop is gone, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
