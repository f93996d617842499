"""The REST face under hostile and unlucky input: every refusal a documented 4xx in Google's JSON error
form, never a 500, never a traceback in the log, and no connection held for ever."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hedgepub.server import LocalServer
from hedgepub.server._api import rest

PROJECT = "projects/hostile"
TOPIC = f"{PROJECT}/topics/topic-1"
SUBSCRIPTION = f"{PROJECT}/subscriptions/sub-1"


@pytest.fixture
def server(caplog: pytest.LogCaptureFixture) -> Iterator[LocalServer]:
    caplog.set_level(logging.INFO, logger="hedgepub.server")
    with LocalServer(in_memory=True) as local:
        yield local
    # No answer above came from an unhandled error: nothing was logged with a traceback.
    assert not [record for record in caplog.records if record.exc_info], caplog.text


def _request(
    server: LocalServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        text = response.read()
        return response.status, json.loads(text) if text else None
    finally:
        connection.close()


def _raw(server: LocalServer, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` on a new connection and read until the answer ends a JSON error, the server closes
    the connection, or ``timeout``."""
    answer = b""
    with socket.create_connection((server.host, server.port), timeout=timeout) as connection:
        connection.sendall(data)
        try:
            while not answer.rstrip().endswith(b"}") and (chunk := connection.recv(65536)):
                answer += chunk
        except TimeoutError:
            pass
    return answer


@pytest.mark.parametrize(
    "body",
    [b"null", b"1", b"true", b'"text"', b"[]", b"[" * 100_000, b'{"a":' * 5_000, b"[" * 101 + b"]" * 101],
    ids=["null", "1", "true", "string", "array", "100k-brackets", "5k-objects", "101-levels"],
)
def test_a_body_that_is_not_a_json_object_is_invalid_argument(server: LocalServer, body: bytes) -> None:
    status, document = _request(server, "PUT", f"/v1/{TOPIC}", body)
    assert status == 400, document
    assert document["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize("data", ["a!G!k=", "aGVs bG8=", "a===", "a", "aGVsbG8=\n", "ü"])
def test_invalid_base64_data_is_refused_not_trimmed(server: LocalServer, data: str) -> None:
    assert _request(server, "PUT", f"/v1/{TOPIC}", b"{}")[0] == 200
    body = json.dumps({"messages": [{"data": data}]}).encode()
    status, document = _request(server, "POST", f"/v1/{TOPIC}:publish", body)
    assert status == 400, document
    assert "Base64" in document["error"]["message"]


@pytest.mark.parametrize("data", ["aGVsbG8=", "aGVsbG8", "-_-_", "+/+/", ""])
def test_standard_and_url_safe_base64_are_taken(server: LocalServer, data: str) -> None:
    assert _request(server, "PUT", f"/v1/{TOPIC}", b"{}")[0] == 200
    body = json.dumps({"messages": [{"data": data, "attributes": {"k": "v"}}]}).encode()
    assert _request(server, "POST", f"/v1/{TOPIC}:publish", body)[0] == 200


def test_a_huge_server_timeout_is_not_an_immediate_deadline(server: LocalServer) -> None:
    _request(server, "PUT", f"/v1/{TOPIC}", b"{}")
    _request(server, "PUT", f"/v1/{SUBSCRIPTION}", json.dumps({"topic": TOPIC}).encode())
    _request(server, "POST", f"/v1/{TOPIC}:publish", json.dumps({"messages": [{"data": "eA=="}]}).encode())
    status, document = _request(
        server, "POST", f"/v1/{SUBSCRIPTION}:pull", b'{"maxMessages": 1}', {"X-Server-Timeout": "1e300"}
    )
    assert status == 200, document
    assert len(document["receivedMessages"]) == 1


def test_expect_continue_far_over_the_limit_is_refused_before_the_body(server: LocalServer) -> None:
    head = (
        f"POST /v1/{TOPIC}:publish HTTP/1.1\r\nHost: x\r\nContent-Length: {rest.MAX_BODY_BYTES * 50}\r\n"
        "Expect: 100-continue\r\n\r\n"
    ).encode()
    answer = _raw(server, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"100 Continue" not in answer


def test_a_non_ascii_authorization_header_is_unauthenticated(server: LocalServer) -> None:
    head = f"GET /v1/{TOPIC} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tökén\r\nConnection: close\r\n\r\n"
    answer = _raw(server, head.encode())
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b'"UNAUTHENTICATED"' in answer


def test_a_client_that_leaves_mid_body_leaves_no_traceback(server: LocalServer) -> None:
    for _ in range(5):
        with socket.create_connection((server.host, server.port), timeout=10) as connection:
            connection.sendall(
                f"POST /v1/{TOPIC}:publish HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{{".encode()
            )
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    time.sleep(0.3)
    assert _request(server, "PUT", f"/v1/{TOPIC}", b"{}")[0] == 200  # still serving; no traceback (fixture)


def test_a_request_head_trickled_too_slowly_is_cut_off(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rest, "HEAD_TIMEOUT_SECONDS", 0.5)
    cut_off = False
    with socket.create_connection((server.host, server.port), timeout=10) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        # A header a byte every 50 ms, never finished, for up to 30 s: the server closes the connection
        # at its head timeout (0.5 s), whether or not each byte arrives in time to look like progress.
        for _ in range(600):
            try:
                connection.sendall(b"X")
            except OSError:
                cut_off = True
                break
            time.sleep(0.05)
            connection.settimeout(0.01)
            try:
                if connection.recv(100) == b"":
                    cut_off = True
                    break
            except TimeoutError:
                pass
    assert cut_off


def test_a_body_that_does_not_arrive_is_answered_408(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rest, "BODY_TIMEOUT_SECONDS", 0.5)
    head = f"POST /v1/{TOPIC}:publish HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode()
    answer = _raw(server, head, timeout=30)  # answered at the body timeout (0.5 s), not the client's
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
