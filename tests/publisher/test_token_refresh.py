"""The token is refreshed ahead of its expiry in the background, against a real token endpoint on loopback
that takes 1 s to answer; an expired token still makes attempts wait for its refresh."""

from __future__ import annotations

import datetime
import http.server
import json
import threading
import time
from collections.abc import Iterator

import google.oauth2.credentials
import pytest
from google.auth import _helpers

from hedgepub import BatchSettings, PublisherClient
from hedgepub.admin import AdminClient
from hedgepub.server import LocalServer

TOPIC = "projects/test-project/topics/tokens"
#: How long the token endpoint takes to answer, as a slow one would.
ENDPOINT_DELAY = 1.0


class SlowTokenEndpoint:
    """An OAuth token endpoint on loopback (real HTTP) that answers each refresh after ``ENDPOINT_DELAY`` s
    with a new token; ``answering`` is set while a request is being held."""

    def __init__(self) -> None:
        self.requests = 0
        self.answering = threading.Event()
        self.answered = threading.Event()
        #: What the test saw happen while the refresh was held, filled by the test (under ``lock``).
        self.lock = threading.Lock()
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with endpoint.lock:
                    endpoint.requests += 1
                    number = endpoint.requests
                endpoint.answering.set()
                endpoint.answered.wait(ENDPOINT_DELAY)  # the slow part (1 s)
                with endpoint.lock:
                    endpoint.answering.clear()
                    endpoint.answered.set()
                body = json.dumps({"access_token": f"t-new-{number}", "expires_in": 3600}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def credentials(self, expires_in: float) -> google.oauth2.credentials.Credentials:
        """User credentials whose token expires in ``expires_in`` seconds and refresh from here."""
        return google.oauth2.credentials.Credentials(
            "t-old",
            refresh_token="refresh",
            token_uri=self.uri,
            client_id="client",
            client_secret="secret",
            expiry=_helpers.utcnow() + datetime.timedelta(seconds=expires_in),
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def token_endpoint() -> Iterator[SlowTokenEndpoint]:
    endpoint = SlowTokenEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.wait_ready(10.0)
            admin.create_topic(TOPIC)
        yield server


def test_a_token_near_its_expiry_is_refreshed_without_holding_back_any_publish(
    server: LocalServer, token_endpoint: SlowTokenEndpoint
) -> None:
    credentials = token_endpoint.credentials(expires_in=120)  # due for its refresh (within 5 minutes)
    with PublisherClient(
        endpoint=f"http://{server.address}",
        credentials=credentials,
        batch_settings=BatchSettings(max_messages=1),
    ) as publisher:
        publisher.publish(TOPIC, b"starts the refresh").result(timeout=60)
        assert token_endpoint.answering.wait(30) or token_endpoint.answered.is_set()
        # While the token endpoint holds its answer, publishes go on, one after the other, with the old token.
        during = 0
        while True:
            publisher.publish(TOPIC, b"during %d" % during).result(timeout=60)
            with token_endpoint.lock:
                if token_endpoint.answered.is_set():
                    break
                during += 1
        assert during >= 5
        # The endpoint flagged its answer before sending it: the new token arrives a moment later.
        deadline = time.monotonic() + 30
        while credentials.token != "t-new-1" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert credentials.token == "t-new-1"
        publisher.publish(TOPIC, b"after").result(timeout=60)
        assert token_endpoint.requests == 1  # one refresh, shared by both connections of the pool


def test_an_expired_token_still_makes_the_attempts_wait_for_its_refresh(
    server: LocalServer, token_endpoint: SlowTokenEndpoint
) -> None:
    credentials = token_endpoint.credentials(expires_in=-1)
    with PublisherClient(
        endpoint=f"http://{server.address}",
        credentials=credentials,
        batch_settings=BatchSettings(max_messages=1),
    ) as publisher:
        future = publisher.publish(TOPIC, b"waits")
        assert token_endpoint.answering.wait(30)
        assert not future.done()
        future.result(timeout=60)
        assert token_endpoint.answered.is_set()  # it resolved only once the refresh had its answer
        assert credentials.token == "t-new-1"
        publisher.publish(TOPIC, b"fresh").result(timeout=60)
        assert token_endpoint.requests == 1
