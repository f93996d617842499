"""Shared fixtures of the trust tests: raw gRPC calls, and the server as a subprocess it can SIGKILL.

The trust tests have a short setting that runs in CI and a long one run by hand, chosen by environment
variables (``HEDGEPUB_TRUST_*``) that each test file documents at its top.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from .._cli import CLI, terminate

HOST = "127.0.0.1"
# No __main__ module in hedgepub.cli: run the console script's function, as the `hedgepub` command does.


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def port_accepts(port: int) -> bool:
    """Whether a TCP connection to 127.0.0.1:``port`` is accepted now."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


class Rpc:
    """Raw unary gRPC calls on one channel: ``rpc.call("Publisher", "CreateTopic", request, Topic)``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)

    def call(self, service: str, method: str, request: Any, response_class: Any, timeout: float = 10) -> Any:
        """Call ``/google.pubsub.v1.{service}/{method}`` and return the parsed response."""
        stub = self.channel.unary_unary(
            f"/google.pubsub.v1.{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_class.FromString,
        )
        return stub(request, timeout=timeout, wait_for_ready=True)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


class ServerProcess:
    """``hedgepub serve`` on a fixed port and data directory, in a subprocess that SIGKILL can end.

    The same port is reused at every restart, so a publisher's channel reconnects by itself.
    """

    def __init__(self, port: int, data_dir: Path, log_path: Path, *, in_memory: bool = False) -> None:
        self.port = port
        self.data_dir = data_dir
        self.log_path = log_path
        self.in_memory = in_memory
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        """``host:port`` for clients."""
        return f"{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> float:
        """Start the server and wait until its port accepts connections; returns the seconds taken."""
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1}\n".encode())
            log.flush()
            store = ["--in-memory"] if self.in_memory else ["--data-dir", str(self.data_dir)]
            self.process = subprocess.Popen(
                [*CLI, "serve", "--host", HOST, "--port", str(self.port), *store],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.starts += 1
        deadline = started + timeout
        while not port_accepts(self.port):
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"server did not accept connections within {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        return time.monotonic() - started

    def rss_bytes(self) -> int:
        """The server process's resident memory now (VmRSS, Linux)."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash or an out-of-memory kill."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        self.process = None

    def stop(self) -> None:
        """A clean stop (SIGTERM), falling back to SIGKILL."""
        process = self.process
        if process is None:
            return
        terminate(process)
        self.process = None

    def log(self) -> str:
        """The server's stderr so far (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    """A not-yet-started :class:`ServerProcess` on a free port and a fresh data directory."""
    server = ServerProcess(free_port(), tmp_path / "data", tmp_path / "server.log")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def make_rpc() -> Iterator[Callable[[str], Rpc]]:
    """Open raw gRPC channels (:class:`Rpc`) to an address; all are closed after the test."""
    opened: list[Rpc] = []

    def make(address: str) -> Rpc:
        rpc = Rpc(address)
        opened.append(rpc)
        return rpc

    try:
        yield make
    finally:
        for rpc in opened:
            rpc.close()
