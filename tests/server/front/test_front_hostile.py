"""The one-port front against clients that hold connections without using them, and against running out
of descriptors; and its relay process restarted after it dies."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from google.cloud import pubsub_v1

from hedgepub.server import LocalServer
from hedgepub.server._front import front as front_module

from .test_front import _relay_processes, _the_relay_process, _wait_for, _wait_gone, linux_only

PROJECT = "projects/front-hostile"


@pytest.mark.parametrize("opening", [b"P", b"PR"])
def test_a_connection_too_short_to_tell_is_parked_not_polled_and_closed_after_a_bound(
    opening: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that send only the start of the HTTP/2 preface and wait: the front looks at each once
    per byte that arrives (not every few milliseconds), and closes them after SNIFF_TIMEOUT_SECONDS."""
    monkeypatch.setattr(front_module, "SNIFF_TIMEOUT_SECONDS", 1.5)
    looks = 0
    sniff = front_module.OnePortFront._sniff

    def counted(self: Any, connection: socket.socket) -> None:
        nonlocal looks
        looks += 1
        sniff(self, connection)

    monkeypatch.setattr(front_module.OnePortFront, "_sniff", counted)
    with LocalServer(in_memory=True) as server:
        connections = [socket.create_connection((server.host, server.port), timeout=5) for _ in range(50)]
        try:
            for connection in connections:
                connection.sendall(opening)
            time.sleep(1.0)
            if sys.platform.startswith("linux"):
                assert looks <= 2 * len(connections), looks  # polled every 5 ms, it would be ~10,000
            # Others are served meanwhile, and a parked connection that goes on is told apart.
            late = connections.pop()
            late.sendall(b"I * HTTP/2.0\r\n\r\nSM\r\n\r\n" if opening == b"PR" else b"UT / HTTP/1.1\r\n\r\n")
            assert late.recv(9)
            late.close()
            monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
            publisher = pubsub_v1.PublisherClient()
            topic = f"{PROJECT}/topics/while-parked"
            assert publisher.create_topic(name=topic).name == topic
            publisher.stop()
            # The rest are closed once the bound is over.
            deadline = time.monotonic() + 5
            for connection in connections:
                connection.settimeout(max(0.1, deadline - time.monotonic()))
                with contextlib.suppress(ConnectionResetError):  # closed with bytes unread: a reset
                    assert connection.recv(10) == b""
        finally:
            for connection in connections:
                connection.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@linux_only
def test_out_of_descriptors_the_front_pauses_accepting_and_logs_once(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from hedgepub.cli import main; main()",
                "serve",
                "--in-memory",
                "--port",
                "0",
                "--relay",
                "loop",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
        )
    held: list[socket.socket] = []
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline().decode()
        address = re.search(r"PUBSUB_EMULATOR_HOST=(\S+)", line)
        assert address is not None, line
        host, port = address.group(1).rsplit(":", 1)
        open_now = len(os.listdir(f"/proc/{serve.pid}/fd"))
        hard = resource.prlimit(serve.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(serve.pid, resource.RLIMIT_NOFILE, (open_now + 20, hard))
        for _ in range(60):  # more connections than descriptors left, each holding an unfinished request
            connection = socket.create_connection((host, int(port)), timeout=5)
            connection.sendall(b"PUT /v1/projects/p/topics/held HTTP/1.1\r\nHost: x\r\n")
            held.append(connection)
        time.sleep(1.0)
        before = _cpu_seconds(serve.pid)
        time.sleep(2.0)
        used = _cpu_seconds(serve.pid) - before
        assert used < 0.5, f"{used:.2f} s of CPU in 2 s while out of descriptors"
        logged = log_path.read_text(errors="replace").count("accepting")
        assert 1 <= logged <= 2, log_path.read_text(errors="replace")[-2000:]
        # Once descriptors are free again, waiting connections are served.
        for connection in held[:50]:
            connection.close()
        waiting = held[-1]
        waiting.sendall(b"Content-Length: 0\r\n\r\n")
        waiting.settimeout(10)
        assert waiting.recv(12).startswith(b"HTTP/1.1")
    finally:
        for connection in held:
            connection.close()
        serve.kill()
        serve.wait()


@linux_only
def test_a_dead_relay_process_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalServer(in_memory=True, relay="process") as server:
        first = _the_relay_process(os.getpid())
        os.kill(first, signal.SIGKILL)
        assert _wait_gone([first]) == []
        assert _wait_for(lambda: [pid for pid in _relay_processes(os.getpid()) if pid != first] != [])
        second = _the_relay_process(os.getpid())
        assert second != first
        # New gRPC connections go through it: it holds their sockets while they are open.
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher = pubsub_v1.PublisherClient()
        try:
            topic = f"{PROJECT}/topics/after-restart"
            assert publisher.create_topic(name=topic).name == topic
            sockets = sum(
                os.readlink(f"/proc/{second}/fd/{fd}").startswith("socket:")
                for fd in os.listdir(f"/proc/{second}/fd")
            )
            assert sockets >= 3  # its control socket and both ends of the relayed connection
        finally:
            publisher.stop()
