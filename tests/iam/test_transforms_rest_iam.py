"""The REST transforms methods (``:validateMessageTransform``, ``:testMessageTransforms``) under IAM, and
their bodies under hostile input.

Under enforcement they authenticate as every other route does: no token, an unknown token or an
Authorization header that is not printable ASCII is 401; a caller needs ``pubsub.topics.create`` or
``pubsub.subscriptions.create`` in the project (what may put a transform on a resource there), or, for a
topic's or subscription's transforms, what GetTopic / GetSubscription need. Their bodies are checked as
the other routes' are: too deep, wrong types and base64 that is not base64 are 400, never 500.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from hedgepub.server import IamConfig, LocalServer

PROJECT = "projects/xform"
TOPIC = f"{PROJECT}/topics/topic-1"
TOKENS = {
    "t-admin": "user:admin@example.com",
    "t-editor": "user:editor@example.com",
    "t-viewer": "user:viewer@example.com",
    "t-nobody": "user:nobody@example.com",
}
POLICY = {
    "bindings": [
        {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
        {"role": "roles/pubsub.editor", "members": ["user:editor@example.com"]},
        {"role": "roles/pubsub.viewer", "members": ["user:viewer@example.com"]},
    ]
}
UDF = {
    "javascriptUdf": {
        "functionName": "up",
        "code": "function up(m){ m.data = m.data.toUpperCase(); return m; }",
    }
}
VALIDATE = json.dumps({"messageTransform": UDF}).encode()
TEST = json.dumps(
    {
        "message": {"data": base64.b64encode(b"abc").decode()},
        "messageTransforms": {"messageTransforms": [UDF]},
    }
).encode()


def _request(
    server: LocalServer, path: str, body: bytes, token: str | None = None, **headers: str
) -> tuple[int, Any]:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        connection.putrequest("POST", path)
        for key, value in {"Content-Length": str(len(body)), **headers}.items():
            connection.putheader(key, value.encode("utf-8"))  # utf-8: a non-ASCII header goes as sent
        connection.endheaders(body)
        response = connection.getresponse()
        text = response.read()
        return response.status, json.loads(text) if text else None
    finally:
        connection.close()


@pytest.fixture(scope="module")
def enforcing() -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, iam=IamConfig(TOKENS, POLICY)) as server:
        assert _put_topic(server, "t-admin") == 200
        yield server


@pytest.fixture
def open_server(caplog: pytest.LogCaptureFixture) -> Iterator[LocalServer]:
    caplog.set_level(logging.INFO, logger="hedgepub.server")
    with LocalServer(in_memory=True) as server:
        yield server
    assert not [record for record in caplog.records if record.exc_info], caplog.text


def _put_topic(server: LocalServer, token: str) -> int:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        connection.request("PUT", f"/v1/{TOPIC}", body=b"{}", headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.mark.parametrize(
    "method, body",
    [("validateMessageTransform", VALIDATE), ("testMessageTransforms", TEST)],
    ids=["validate", "test"],
)
@pytest.mark.parametrize("token", [None, "t-bogus"], ids=["no-token", "bogus-token"])
def test_a_caller_without_a_known_token_is_401(
    enforcing: LocalServer, method: str, body: bytes, token: str | None
) -> None:
    status, document = _request(enforcing, f"/v1/{PROJECT}:{method}", body, token)
    assert status == 401, document
    assert document["error"]["status"] == "UNAUTHENTICATED"


@pytest.mark.parametrize(
    "method, body",
    [("validateMessageTransform", VALIDATE), ("testMessageTransforms", TEST)],
    ids=["validate", "test"],
)
def test_a_non_ascii_authorization_header_is_401_not_500(
    enforcing: LocalServer, method: str, body: bytes
) -> None:
    status, document = _request(enforcing, f"/v1/{PROJECT}:{method}", body, Authorization="Bearer tökén")
    assert status == 401, document
    assert document["error"]["status"] == "UNAUTHENTICATED"


@pytest.mark.parametrize(
    "method, body",
    [("validateMessageTransform", VALIDATE), ("testMessageTransforms", TEST)],
    ids=["validate", "test"],
)
def test_a_caller_who_may_not_create_resources_is_403(
    enforcing: LocalServer, method: str, body: bytes
) -> None:
    for token in ("t-viewer", "t-nobody"):
        status, document = _request(enforcing, f"/v1/{PROJECT}:{method}", body, token)
        assert status == 403, (token, document)
        assert document["error"]["status"] == "PERMISSION_DENIED"


def test_an_editor_validates_and_tests(enforcing: LocalServer) -> None:
    assert _request(enforcing, f"/v1/{PROJECT}:validateMessageTransform", VALIDATE, "t-editor") == (200, {})
    status, document = _request(enforcing, f"/v1/{PROJECT}:testMessageTransforms", TEST, "t-editor")
    assert status == 200, document
    data = document["transformedMessages"][0]["transformedMessage"]["data"]
    assert base64.b64decode(data) == b"ABC"


def test_a_topics_transforms_need_what_get_topic_needs(enforcing: LocalServer) -> None:
    body = json.dumps({"message": {"data": "eA=="}, "topic": TOPIC}).encode()
    assert _request(enforcing, f"/v1/{PROJECT}:testMessageTransforms", body, "t-nobody")[0] == 403
    assert _request(enforcing, f"/v1/{PROJECT}:testMessageTransforms", body)[0] == 401
    assert _request(enforcing, f"/v1/{PROJECT}:testMessageTransforms", body, "t-viewer") == (200, {})


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"message": ' * 50_000,
        json.dumps(
            {"message": {"data": "eA=="}, "messageTransforms": {"messageTransforms": [[[[[]]]]] * 1}}
        ).encode(),
        json.dumps({"message": {"data": "eA=="}, "topic": 5}).encode(),
        json.dumps({"message": {"data": "eA=="}, "subscription": ["a"]}).encode(),
        json.dumps(
            {"message": {"data": "a!G!k="}, "messageTransforms": {"messageTransforms": [UDF]}}
        ).encode(),
        json.dumps({"message": "text", "messageTransforms": {"messageTransforms": [UDF]}}).encode(),
        json.dumps({"message": {"data": "eA=="}, "messageTransforms": [UDF]}).encode(),
        json.dumps(
            {"message": {"attributes": {"k": 5}}, "messageTransforms": {"messageTransforms": [UDF]}}
        ).encode(),
        b"\xff\xfe not json",
    ],
    ids=[
        "100k-brackets",
        "50k-objects",
        "nested-lists",
        "topic-number",
        "subscription-list",
        "bad-base64",
        "message-string",
        "transforms-list",
        "attribute-number",
        "not-utf8",
    ],
)
def test_a_bad_test_body_is_400(open_server: LocalServer, body: bytes) -> None:
    status, document = _request(open_server, f"/v1/{PROJECT}:testMessageTransforms", body)
    assert status == 400, document
    assert document["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"messageTransform": ' * 50_000,
        b'{"messageTransform": 5}',
        b'{"messageTransform": [1]}',
        b"null",
        b'{"messageTransform": {"javascriptUdf": {"code": 5}}}',
    ],
    ids=["100k-brackets", "50k-objects", "number", "list", "null", "code-number"],
)
def test_a_bad_validate_body_is_400(open_server: LocalServer, body: bytes) -> None:
    status, document = _request(open_server, f"/v1/{PROJECT}:validateMessageTransform", body)
    assert status == 400, document
    assert document["error"]["status"] == "INVALID_ARGUMENT"
