"""The data directory: one server at a time, and checked before the server says it is ready.

:func:`open_data_dir` runs before the store is opened and returns a :class:`DataDirLock` the server holds
until it stops:

1. the directory is created if missing;
2. an exclusive ``flock`` on ``D/lock`` (which holds the owner's process ID) keeps a second server off the
   directory; the kernel drops the lock when the process ends, however it ends, so a ``kill -9`` leaves
   nothing to clean up;
3. a small file is written, synced and removed, so a directory that cannot be written (read-only file
   system, immutable, no permission) is found now rather than by the first Publish;
4. the database, when there is one, must be writable, open as SQLite and pass ``PRAGMA quick_check``.

Any failure is a :class:`DataDirError` whose message is one line naming the directory or file and what is
wrong; ``hedgepub serve`` prints it and exits 1.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from pathlib import Path

#: The lock file inside the data directory.
LOCK_FILE = "lock"
#: The SQLite database inside the data directory.
DATABASE_FILE = "pubsub.sqlite3"
#: The key that signs push requests' OIDC tokens (made when first needed; see ``_oidc.py``).
PUSH_KEY_FILE = "push-signing-key.pem"


class DataDirError(Exception):
    """The data directory cannot be used; the message is one line naming the file and the problem."""


def database_path(data_dir: str | os.PathLike[str]) -> Path:
    """Where the server keeps its SQLite database in ``data_dir``."""
    return Path(data_dir) / DATABASE_FILE


def push_key_path(data_dir: str | os.PathLike[str]) -> Path:
    """Where the server keeps the key that signs push requests' OIDC tokens in ``data_dir``."""
    return Path(data_dir) / PUSH_KEY_FILE


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


class DataDirLock:
    """An exclusive lock on a data directory, held from :func:`open_data_dir` until :meth:`release`."""

    def __init__(self, directory: Path, descriptor: int) -> None:
        self.directory = directory
        self._descriptor: int | None = descriptor

    @property
    def held(self) -> bool:
        """Whether the lock is still held."""
        return self._descriptor is not None

    def release(self) -> None:
        """Give the directory up (closing the file drops the lock); harmless when already released."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)

    def __repr__(self) -> str:
        return f"DataDirLock({str(self.directory)!r}, {'held' if self.held else 'released'})"


def _lock(directory: Path) -> DataDirLock:
    import fcntl

    path = directory / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise DataDirError(f"data directory {directory} cannot be written: {_reason(error)}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        owner = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
        os.close(descriptor)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DataDirError(f"data directory {directory} cannot be locked: {_reason(error)}") from None
        holder = f"process {owner}" if owner.isdigit() else "another process"
        raise DataDirError(f"data directory {directory} is in use by {holder}") from None
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    except OSError as error:
        os.close(descriptor)
        raise DataDirError(f"data directory {directory} cannot be written: {_reason(error)}") from None
    return DataDirLock(directory, descriptor)


def _probe_writable(directory: Path) -> None:
    """Create, write, sync and remove a file: what the store will need to do."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, b"hedgepub")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        probe.unlink()
    except OSError as error:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise DataDirError(f"data directory {directory} cannot be written: {_reason(error)}") from None


def check_database(path: Path) -> None:
    """An existing database must be writable, open as SQLite and pass ``PRAGMA quick_check``."""
    if not path.exists() or path.stat().st_size == 0:
        return  # a new (or never written) database: SQLite creates it
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists():
            try:
                with open(file, "r+b"):
                    pass
            except OSError as error:
                raise DataDirError(f"database file {file} cannot be written: {_reason(error)}") from None
    try:
        connection = sqlite3.connect(f"file:{path}?mode=rw", uri=True, isolation_level=None)
    except sqlite3.Error as error:
        raise DataDirError(f"database file {path} cannot be opened: {error}") from None
    try:
        rows = connection.execute("PRAGMA quick_check").fetchall()
    except sqlite3.Error as error:
        raise DataDirError(f"database file {path} cannot be read as SQLite: {error}") from None
    finally:
        connection.close()
    problems = [str(row[0]) for row in rows if row and row[0] != "ok"]
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        first = " ".join(problems[0].split())
        raise DataDirError(f"database file {path} fails SQLite's quick check: {first}{more}")


def open_data_dir(data_dir: str | os.PathLike[str]) -> DataDirLock:
    """Create ``data_dir`` if needed, lock it, and check that it can be written and its database read.

    Returns the held lock (release it when the server stops); raises :class:`DataDirError`.
    """
    directory = Path(data_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataDirError(f"data directory {directory} is a file, not a directory") from None
    except OSError as error:
        raise DataDirError(f"data directory {directory} cannot be created: {_reason(error)}") from None
    if not directory.is_dir():
        raise DataDirError(f"data directory {directory} is a file, not a directory")
    lock = _lock(directory)
    try:
        _probe_writable(directory)
        check_database(database_path(directory))
    except BaseException:
        lock.release()
        raise
    return lock


# ------------------------------------------------------------------------------------------- a full disk
#: SQLite's primary result code for "database or disk is full" (extended codes keep it in the low byte).
_SQLITE_FULL = 13

#: What a client is told when a write fails because the disk is full. UNAVAILABLE, not
#: RESOURCE_EXHAUSTED: the real service uses RESOURCE_EXHAUSTED for a caller over its quota or flow
#: control (the caller should send less), UNAVAILABLE for the service being unable to serve for now (retry
#: with back-off), which is the case here; and the official clients retry UNAVAILABLE on every RPC that
#: writes (Publish, Acknowledge, ModifyAckDeadline, Create/Update/Delete...), RESOURCE_EXHAUSTED only on
#: Publish and StreamingPull, so an acknowledgement answered RESOURCE_EXHAUSTED would be dropped.
DISK_FULL_MESSAGE = (
    "The server cannot store this request now: the disk holding its data is full. Nothing was stored; "
    "retry with back-off, it is served again as soon as space is freed."
)


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) says the disk, or SQLite's size limit, is full."""
    while error is not None:
        if isinstance(error, sqlite3.Error):
            code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
            if code is not None:
                return code & 0xFF == _SQLITE_FULL
            return "database or disk is full" in str(error)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__
    return False
