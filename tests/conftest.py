"""Fixtures shared by several test directories: polling for a condition, a real HTTP push endpoint, a
throwaway CA and server certificate for TLS."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ._tls import Certificates, make_certificates

#: Whether QuickJS is installed. CI leaves it out on the Python versions it has no wheel for (it would be
#: compiled from source, for many minutes, each run): there the tests marked ``quickjs`` skip, saying so.
HAS_QUICKJS = importlib.util.find_spec("quickjs") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``quickjs`` where QuickJS is not installed."""
    if HAS_QUICKJS:
        return
    skip = pytest.mark.skip(
        reason="runs JavaScript UDFs: needs QuickJS (the quickjs module of the server extra), not installed"
    )
    for item in items:
        if item.get_closest_marker("quickjs") is not None:
            item.add_marker(skip)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    """Poll a condition until it holds (or 10 s pass); only where a real client's threads do the work."""
    return _wait_for


@dataclass(frozen=True)
class PushRequest:
    """One POST the endpoint received."""

    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it arrived
    status: int  # what the endpoint answered


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that drops its keep-alive connection (a killed server does) is no error here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class PushEndpoint:
    """An HTTP/1.1 server on an ephemeral port of 127.0.0.1 that records every POST.

    It answers ``status`` (settable at any time: 200 to acknowledge, 500 to refuse), each answer after
    the next of ``delays`` (seconds; none once they are used up). ``check``, when set, is called with
    each request's headers first, and a status it returns is answered instead (an endpoint that checks
    authentication answers 401 or 403). ``location``, when set, is sent as a ``Location`` header (with a
    3xx ``status``, a redirect), and ``answer_bytes`` bytes of body follow each answer (in 64 KiB chunks,
    counted in ``answer_bytes_sent`` until the client stops reading; ``answers_ended`` counts the answers
    written in full or cut off). A GET is recorded too (answered 200).
    """

    def __init__(self) -> None:
        self.status = 200
        self.location: str | None = None
        self.answer_bytes = 0
        self.answer_bytes_sent = 0
        #: Answers whose body is written in full or cut off by the client closing the connection.
        self.answers_ended = 0
        self.check: Callable[[dict[str, str]], int | None] | None = None
        self.delays: list[float] = []
        self.requests: list[PushRequest] = []
        self._changed = threading.Condition()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real endpoint

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                check = endpoint.check
                refused = check(dict(self.headers.items())) if check is not None else None
                status = endpoint.status if refused is None else refused
                with endpoint._changed:
                    delay = endpoint.delays.pop(0) if endpoint.delays else 0.0
                    endpoint.requests.append(
                        PushRequest(self.path, dict(self.headers.items()), body, time.monotonic(), status)
                    )
                    endpoint._changed.notify_all()
                if delay:
                    time.sleep(delay)  # an endpoint that is slow to answer
                self.send_response(status)
                if endpoint.location is not None:
                    self.send_header("Location", endpoint.location)
                self.send_header("Content-Length", str(endpoint.answer_bytes))
                self.end_headers()
                chunk = b"x" * 65536
                left = endpoint.answer_bytes
                try:
                    while left > 0:
                        size = min(left, len(chunk))
                        self.wfile.write(chunk[:size])
                        left -= size
                        endpoint.answer_bytes_sent += size
                except OSError:
                    self.close_connection = True
                with endpoint._changed:
                    endpoint.answers_ended += 1
                    endpoint._changed.notify_all()

            def do_GET(self) -> None:
                with endpoint._changed:
                    endpoint.requests.append(
                        PushRequest(self.path, dict(self.headers.items()), b"", time.monotonic(), 200)
                    )
                    endpoint._changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="push-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The endpoint's URL (path ``/push``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/push"

    def wait_for(self, condition: Callable[[list[PushRequest]], bool], timeout: float = 30.0) -> bool:
        """Wait until ``condition(requests so far)`` holds; False after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._changed:
            while not condition(self.requests):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def push_endpoint() -> Iterator[PushEndpoint]:
    """A running :class:`PushEndpoint`, closed after the test."""
    endpoint = PushEndpoint()
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost it signed (``cryptography``)."""
    return make_certificates(tmp_path_factory.mktemp("tls"))
