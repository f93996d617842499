"""Differential fixtures: the same calls against ``hedgepub serve`` and Google's Pub/Sub emulator.

``target`` runs a test once on a fresh in-memory local server and once on Google's emulator (one JVM
for the whole session, started on first use); the emulator's run is skipped where it is not installed
(gcloud's ``pubsub-emulator`` component, or ``$PUBSUB_EMULATOR_BIN``). A test asserts what the reference
documents: where the emulator answers otherwise, the test takes ``hedgepub`` alone and says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from hedgepub.server import LocalServer
from hedgepub.server._methods import METHODS, RPCS


def emulator_binary() -> Path | None:
    """Google's Pub/Sub emulator launcher: ``$PUBSUB_EMULATOR_BIN``, else next to gcloud's SDK."""
    configured = os.environ.get("PUBSUB_EMULATOR_BIN")
    if configured:
        return Path(configured) if Path(configured).exists() else None
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    sdk = Path(os.path.realpath(gcloud)).parent.parent
    candidate = sdk / "platform" / "pubsub-emulator" / "bin" / "cloud-pubsub-emulator"
    return candidate if candidate.exists() else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def google_emulator() -> Iterator[str]:
    """The address of Google's emulator, started once per session (skips the test if not installed)."""
    binary = emulator_binary()
    if binary is None:
        pytest.skip("Google's Pub/Sub emulator is not installed (gcloud's pubsub-emulator component)")
    port = _free_port()
    process = subprocess.Popen(
        [str(binary), "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail("Google's emulator did not start within 90 s")
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the launcher script and its JVM
        process.wait(30)


@dataclass
class Target:
    """One server under test: its kind (``hedgepub`` or ``emulator``), address and a raw gRPC channel."""

    kind: str
    address: str
    channel: grpc.Channel

    def name(self, collection: str, stem: str) -> str:
        """A fresh resource name (the emulator lives for the whole session: names must not repeat)."""
        return f"projects/conformance/{collection}/{stem}-{uuid.uuid4().hex[:10]}"

    def call(self, method: str, request: Any, timeout: float = 10.0) -> Any:
        """Call ``method`` (short name) with a raw protobuf request; raises ``grpc.RpcError``."""
        stub = self.channel.unary_unary(
            METHODS[method],
            request_serializer=type(request).SerializeToString,
            response_deserializer=RPCS[method].response_class.FromString,
        )
        return stub(request, timeout=timeout)

    def error(self, method: str, request: Any) -> grpc.RpcError:
        """Call ``method`` expecting a failure; return the error."""
        with pytest.raises(grpc.RpcError) as caught:
            self.call(method, request)
        return caught.value


@pytest.fixture
def hedgepub_target() -> Iterator[Target]:
    """A fresh in-memory local server."""
    with LocalServer(host="127.0.0.1", port=0, in_memory=True) as server:
        channel = grpc.insecure_channel(server.address)
        try:
            yield Target("hedgepub", server.address, channel)
        finally:
            channel.close()


@pytest.fixture(params=["hedgepub", "emulator"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """Each server in turn: the local server, then Google's emulator (skipped where absent)."""
    if request.param == "hedgepub":
        yield request.getfixturevalue("hedgepub_target")
        return
    address = request.getfixturevalue("google_emulator")
    channel = grpc.insecure_channel(address)
    try:
        yield Target("emulator", address, channel)
    finally:
        channel.close()
