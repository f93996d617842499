"""The data directory: one server per directory, and a one-line error, never a traceback or a "ready"
server that cannot store, for a damaged database or a directory that cannot be written.

Tests run as root on these machines, and root ignores permission bits, so "cannot be written" is made real
in two other ways: the immutable attribute (``chattr +i``, refused even to root) and a read-only tmpfs
mount; each test skips itself where the machine does not allow it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.cloud import pubsub_v1

from hedgepub.bench import AdminClient
from hedgepub.server import DataDirError, LocalServer
from hedgepub.server._store.datadir import DATABASE_FILE, DISK_FULL_MESSAGE

from ..._cli import CLI, served_address
from ..._pb import PublishRequest, PublishResponse, PubsubMessage

pytestmark = pytest.mark.skipif(os.name != "posix", reason="flock, chattr and mounts are POSIX")

TOPIC = "projects/p/topics/orders"


def _serve(data_dir: Path, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """``hedgepub serve`` on ``data_dir`` when it is expected not to start."""
    return subprocess.run(
        [*CLI, "serve", "--port", "0", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_line_error(completed: subprocess.CompletedProcess[str]) -> str:
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout == ""  # no `export PUBSUB_EMULATOR_HOST=...`: it never said it was ready
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    return lines[0]


def _publish_some(server: LocalServer, count: int = 300) -> None:
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    with grpc.insecure_channel(server.address) as channel:
        publish = _publish_call(channel)
        message = PubsubMessage
        for start in range(0, count, 100):
            batch = [message(data=os.urandom(200)) for _ in range(start, min(count, start + 100))]
            publish(PublishRequest(topic=TOPIC, messages=batch), timeout=10)


# --------------------------------------------------------------------------------------------- one server
def test_a_second_server_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    with LocalServer(data_dir=tmp_path):
        with pytest.raises(DataDirError) as refused:
            LocalServer(data_dir=tmp_path).start()
        assert str(refused.value) == f"data directory {tmp_path} is in use by process {os.getpid()}"
    # stopped: the directory is free again
    with LocalServer(data_dir=tmp_path) as again:
        assert again.running


def test_a_second_serve_exits_1_naming_the_process_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    first = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        served_address(first, timeout=15)
        line = _one_line_error(_serve(tmp_path))
        assert line == f"Error: data directory {tmp_path} is in use by process {first.pid}"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    # the kernel dropped the lock with the process: the directory is usable at once
    with LocalServer(data_dir=tmp_path) as server:
        assert server.running


# ------------------------------------------------------------------------------------------ the database
def test_a_file_that_is_not_a_database_gives_one_line(tmp_path: Path) -> None:
    (tmp_path / DATABASE_FILE).write_bytes(b"these are not the bytes of an SQLite database\n" * 100)
    line = _one_line_error(_serve(tmp_path))
    assert line.startswith(f"Error: database file {tmp_path / DATABASE_FILE} ")
    assert "file is not a database" in line


def test_a_damaged_database_fails_the_quick_check_in_one_line(tmp_path: Path) -> None:
    with LocalServer(data_dir=tmp_path) as server:
        _publish_some(server)
    database = tmp_path / DATABASE_FILE
    with sqlite3.connect(database) as connection:  # everything into the main file, then damage it
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
    assert pages > 6
    with open(database, "r+b") as file:  # a run of pages in the middle, as a bad sector would
        file.seek(page_size * (pages // 2))
        file.write(b"\xa5" * page_size * 3)
    line = _one_line_error(_serve(tmp_path))
    assert line.startswith(f"Error: database file {database} ")
    assert "quick check" in line or "malformed" in line

    with pytest.raises(DataDirError, match=r"quick check|malformed"):
        LocalServer(data_dir=tmp_path).start()


def test_a_healthy_database_passes_and_keeps_its_messages(tmp_path: Path) -> None:
    with LocalServer(data_dir=tmp_path) as server:
        _publish_some(server, 100)
    with LocalServer(data_dir=tmp_path) as server:
        assert len(server.messages(TOPIC)) == 100


# ---------------------------------------------------------------------------- a directory not writable
def test_a_path_under_a_file_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = _one_line_error(_serve(blocker / "data"))
    assert line == f"Error: data directory {blocker / 'data'} cannot be created: Not a directory"


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False).returncode == 0


@pytest.fixture
def immutable_dir(tmp_path: Path) -> Iterator[Path]:
    """A data directory (holding a database) with the immutable attribute: nothing can be created in it."""
    data = tmp_path / "data"
    with LocalServer(data_dir=data) as server:
        _publish_some(server, 10)
    if not _chattr("+i", data):
        pytest.skip("chattr +i is not available here (needs root and a file system that supports it)")
    try:
        yield data
    finally:
        _chattr("-i", data)


def test_an_immutable_directory_is_refused_before_ready(immutable_dir: Path) -> None:
    line = _one_line_error(_serve(immutable_dir))
    assert line == f"Error: data directory {immutable_dir} cannot be written: Operation not permitted"


def test_an_immutable_database_file_is_refused(tmp_path: Path) -> None:
    with LocalServer(data_dir=tmp_path) as server:
        _publish_some(server, 10)
    database = tmp_path / DATABASE_FILE
    if not _chattr("+i", database):
        pytest.skip("chattr +i is not available here")
    try:
        line = _one_line_error(_serve(tmp_path))
    finally:
        _chattr("-i", database)
    assert line == f"Error: database file {database} cannot be written: Operation not permitted"


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, options: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        for _ in range(50):  # a child that just exited may still hold it for a moment
            if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode == 0:
                break
            time.sleep(0.1)


def test_a_read_only_file_system_is_refused_before_ready(tmp_path: Path) -> None:
    data = tmp_path / "read-only"
    with _mounted_tmpfs(data, "ro,size=1m"):
        line = _one_line_error(_serve(data))
    assert line == f"Error: data directory {data} cannot be written: Read-only file system"


# ------------------------------------------------------------------------------------------ a full disk
def _publish_call(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        "/google.pubsub.v1.Publisher/Publish",
        request_serializer=PublishRequest.SerializeToString,
        response_deserializer=PublishResponse.FromString,
    )


def _fill(path: Path) -> None:
    """Write ``path`` until the file system has no space left.

    Unbuffered: a buffered file keeps what its failed write could not store and, closing, tries to write
    it again, which raises ENOSPC a second time (out of the ``with``, when the space ran out mid-chunk)."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as ballast:
        try:
            while True:
                ballast.write(chunk)
                ballast.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


def test_a_full_disk_answers_unavailable_and_the_server_recovers_when_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tmp_path / "small"
    with _mounted_tmpfs(small, "size=8m"), LocalServer(data_dir=small / "data") as server:
        _publish_some(server, 10)  # the topic, and messages stored before the disk fills
        with AdminClient(server.address) as admin:
            admin.create_subscription("projects/p/subscriptions/audit", TOPIC)
        with grpc.insecure_channel(server.address) as channel:
            publish = _publish_call(channel)
            stored = 10
            _fill(small / "ballast")
            payload = PubsubMessage(data=b"x" * 200_000)
            refused = None
            for _ in range(100):  # what is left of the WAL and the pages fills within a few requests
                try:
                    publish(PublishRequest(topic=TOPIC, messages=[payload]), timeout=10)
                    stored += 1
                except grpc.RpcError as error:
                    refused = error
                    break
            assert refused is not None, "the disk never filled"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.details() == DISK_FULL_MESSAGE
            assert server.running
            # The official publisher retries UNAVAILABLE: a publish made while the disk is full succeeds
            # once space returns, on the same server, with no restart.
            monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
            official = pubsub_v1.PublisherClient()
            future = official.publish(TOPIC, b"y" * 200_000)
            time.sleep(0.5)
            assert not future.done()
            (small / "ballast").unlink()
            assert future.result(timeout=60)
            stored += 1
            for _ in range(3):
                publish(PublishRequest(topic=TOPIC, messages=[payload]), timeout=10)
                stored += 1
            assert len(server.messages(TOPIC)) == stored  # the refused request left nothing behind
