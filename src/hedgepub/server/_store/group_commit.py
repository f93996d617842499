"""Group commit: one writer thread that runs every queued write operation of a SQLite store, folding
whatever is queued at that moment into one transaction, and gives freed pages back in small steps.

Many concurrent Publish calls cost one commit, and the event loop never waits on the disk. Each caller's
future resolves only after the commit that holds its change. One operation that fails does not fail the
others folded with it: they are retried each in a transaction of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["GroupCommitWriter", "Operation", "Statement"]

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

#: Most operations folded into one transaction, so one commit never grows without bound.
_MAX_GROUP = 512
#: Free pages are given back to the file system (incremental vacuum) once they are this share of the file
#: and at least ``_VACUUM_MIN_PAGES``; below that SQLite reuses them for new rows, which is cheaper.
_VACUUM_SHARE = 0.25
_VACUUM_MIN_PAGES = 2048
#: At most this many pages (8 MiB) go back per step, so that one step holds up the writer only briefly.
_VACUUM_STEP_PAGES = 2048
#: Commits between two looks at the free pages.
_VACUUM_CHECK_EVERY = 16


class GroupCommitWriter:
    """The writer thread of one database: ``connect()`` opens its connection (in the thread, when the
    first write comes)."""

    def __init__(self, connect: Callable[[], sqlite3.Connection]) -> None:
        self._connect = connect
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._writer_thread: threading.Thread | None = None
        self._closed = False
        self.commits = 0  # transactions committed, for tests and benchmarks of group commit

    async def write(self, operation: Operation) -> None:
        """Queue ``operation`` and return once the transaction that ran it committed (or raise its error)."""
        if self._closed:
            raise RuntimeError("the store is closed")
        if self._writer_thread is None:
            self._writer_thread = threading.Thread(
                target=self._write_loop, name="hedgepub-sqlite", daemon=True
            )
            self._writer_thread.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((operation, future, loop))
        # Shielded: a cancelled caller must not make us forget whether its write committed.
        await asyncio.shield(future)

    def _write_loop(self) -> None:
        connection = self._connect()
        # Whether free pages may be worth giving back: looked at after every _VACUUM_CHECK_EVERY commits,
        # and whenever the queue has been empty for a quarter second (so an idle server shrinks its file).
        vacuum_due = False
        commits = 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.25) if vacuum_due else self._queue.get()
                except queue.Empty:
                    vacuum_due = self._vacuum_step(connection)
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
                self._commit(connection, group)
                if stop:
                    return
                commits += 1
                if commits % _VACUUM_CHECK_EVERY == 0:
                    vacuum_due = self._vacuum_step(connection)
        finally:
            connection.close()

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

    def _commit(self, connection: sqlite3.Connection, group: list[Any]) -> None:
        if len(group) == 1 and isinstance(group[0][0], Statement):
            statement = group[0][0]
            try:
                connection.execute(statement.sql, statement.parameters)
            except Exception as error:
                _resolve(group[0], error=error)
                return
            self.commits += 1
            _resolve_all(group)
            return
        try:
            connection.execute("BEGIN IMMEDIATE")
            for operation, _, _ in group:
                operation(connection)
            connection.execute("COMMIT")
            self.commits += 1
        except Exception as error:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if len(group) == 1:
                _resolve(group[0], error=error)
                return
            # One bad operation must not fail the others: retry each in a transaction of its own.
            for item in group:
                self._commit(connection, [item])
            return
        _resolve_all(group)

    async def close(self) -> None:
        """Let every queued write commit, then stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        thread = self._writer_thread
        if thread is not None:
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)


def _resolve_all(group: list[Any]) -> None:
    """Settle a committed group's futures with one wake-up per event loop, not one per write: each
    ``call_soon_threadsafe`` writes to the loop's self-pipe, which cost more than settling the futures."""
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


def _resolve(item: Any, error: BaseException | None = None) -> None:
    _, future, loop = item

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # RuntimeError: the caller's loop is gone, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
