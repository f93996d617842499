"""Bad input through the REST front: JSON bodies drawn for every route."""

from __future__ import annotations

import http.client
import json
from typing import Any

import grpc
from hypothesis import given
from hypothesis import strategies as st

from hedgepub.server import LocalServer

from ._common import (
    CASES,
    CODES,
    FUZZ_SUBSCRIPTION,
    FUZZ_TOPIC,
    GOOD_TOPIC,
    PB,
    Client,
    examples,
)

#: Statuses a REST call may answer with (the HTTP forms of the documented codes; 413 for a body over the
#: size limit). Never 500: that would be an unhandled error.
REST_DOCUMENTED = frozenset({200, 400, 401, 403, 404, 409, 413, 429})


_REST_ROUTES = [
    ("PUT", "/v1/projects/fuzz/topics/rest-fuzz"),
    ("PATCH", f"/v1/{FUZZ_TOPIC}"),
    ("POST", f"/v1/{FUZZ_TOPIC}:publish"),
    ("PUT", "/v1/projects/fuzz/subscriptions/rest-fuzz"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:pull"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:acknowledge"),
    ("POST", f"/v1/{FUZZ_SUBSCRIPTION}:modifyAckDeadline"),
    ("POST", "/v1/projects/fuzz/schemas:validateMessage"),
    ("POST", f"/v1/{FUZZ_TOPIC}:setIamPolicy"),
    ("POST", "/v1/projects/fuzz:testMessageTransforms"),
    ("POST", "/v1/projects/fuzz:validateMessageTransform"),
]


_FIELD_NAMES = st.sampled_from(
    ["messages", "data", "attributes", "orderingKey", "topic", "filter", "ackDeadlineSeconds", "pushConfig",
     "pushEndpoint", "maxMessages", "ackIds", "labels", "policy", "bindings", "message", "encoding", "schema",
     "type", "definition", "updateMask", "subscription", "retryPolicy", "minimumBackoff", "messageTransform",
     "messageTransforms", "javascriptUdf", "code", "functionName", "compression", "disabled", "x"]
)  # fmt: skip


_JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["a!G!k=", "aGVs bG8=", "aGVsbG8=", "-_-_", "\\x0", "10s", "1e300s", FUZZ_TOPIC]),
)  # fmt: skip


_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_FIELD_NAMES, inner, max_size=4),
    max_leaves=25,
)


_REST_BODIES = st.one_of(
    _JSON.map(lambda value: json.dumps(value).encode()),
    st.dictionaries(_FIELD_NAMES, _JSON, max_size=5).map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=100),
    st.tuples(st.sampled_from(["[", "{", '{"messages": [', '{"a": ', '"']), st.integers(1, 200_000)).map(
        lambda pair: (pair[0] * pair[1]).encode()
    ),
    st.sampled_from([b"null", b"1", b"true", b'"s"', b"[]", b"{}", b"", b"\xff\xfe"]),
)


def _rest(
    server: LocalServer, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        text = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


@examples(1500)
@given(
    route=st.sampled_from(_REST_ROUTES),
    body=_REST_BODIES,
    timeout=st.sampled_from([None, "1e300", "-1", "nan", "0.5", "x"]),
)
def test_rest_bodies(
    client: Client, server: LocalServer, route: tuple[str, str], body: bytes, timeout: str | None
) -> None:
    """Any body to any REST route: a documented 4xx in Google's JSON error form, never a 500."""
    CASES["REST body"] += 1
    method, path = route
    headers = {"Content-Type": "application/json"}
    if timeout is not None:
        headers["X-Server-Timeout"] = timeout
    status, document = _rest(server, method, path, body, headers)
    CODES[(f"REST {method}", str(status))] += 1
    assert status in REST_DOCUMENTED, f"{method} {path} answered {status}: {str(document)[:300]}"
    if status != 200:
        assert isinstance(document, dict) and document["error"]["status"] not in ("INTERNAL", "UNKNOWN"), (
            document
        )
    still = client.call("GetTopic", PB["GetTopicRequest"](topic=GOOD_TOPIC))
    assert still[0] == grpc.StatusCode.OK
