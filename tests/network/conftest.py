"""Fixtures of the network fault tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._network import EchoServer


@pytest.fixture
def echo_server() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()
