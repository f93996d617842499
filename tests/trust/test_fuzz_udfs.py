"""Fuzzed JavaScript UDFs: code drawn from hostile pieces (results of every shape, lone surrogates,
overridden built-ins, frozen globals, huge errors, heap and time hogs), on a topic at create and publish
and through ``:testMessageTransforms``. Every answer is a documented status (OK or INVALID_ARGUMENT; 200
or 400), never INTERNAL or a 500, and the server serves on.

Settings: ``HEDGEPUB_TRUST_EXAMPLES`` multiplies the examples (default 1).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.pubsub_v1.types import pubsub as pubsub_types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hedgepub.server import LocalServer

from .conftest import Rpc

Topic = pubsub_types.Topic.pb()
PublishRequest = pubsub_types.PublishRequest.pb()
PublishResponse = pubsub_types.PublishResponse.pb()
GetTopicRequest = pubsub_types.GetTopicRequest.pb()
DeleteTopicRequest = pubsub_types.DeleteTopicRequest.pb()
Empty: Any = __import__("google.protobuf.empty_pb2", fromlist=["Empty"]).Empty

SCALE = int(os.environ.get("HEDGEPUB_TRUST_EXAMPLES", "1"))
PROBE = "projects/fuzz-udf/topics/probe"

_TOP_LEVEL = st.sampled_from(
    [
        "",
        "var kept = 0;",
        "JSON.stringify = function(){ return 'x'; };",
        "JSON.parse = null;",
        "Object.freeze(globalThis);",
        "Object.keys = function(){ return ['data']; };",
        "String.prototype.toJSON = function(){ return 1; };",
        "Object.prototype.toJSON = function(){ return 1; };",
        "Array.isArray = function(){ return true; };",
        "var big = 'x'.repeat(1 << 20);",
        "throw new Error('top');",
        "Object.defineProperty(globalThis, 'f', {get: function(){ throw 1; }});",
    ]
)
_STATEMENTS = st.sampled_from(
    [
        "m.data = m.data.substring(0, 3);",
        "m.data = m.data + '\\ud800';",
        "m.data = m.data.split('').reverse().join('');",
        "m.attributes.k = 'v';",
        "m.attributes.k = 'x\\udc00';",
        "m.attributes = {a: 1};",
        "m.attributes = null;",
        "m.attributes = [1, 2];",
        "delete m.data;",
        "m.data = 5;",
        "m.data = m.data.replace(/a/g, 'bb');",
        "/(a+)+$/.test('aaaaaaaaaaaaaaaaaa!');",
        "var s = 'ab'; for (var i = 0; i < 22; i++) s += s;",
        "throw new Error('x'.repeat(20000));",
        "throw 5;",
        "m = new Proxy(m, {get: function(){ throw new Error('proxy'); }});",
        "kept = (typeof kept === 'number' ? kept : 0) + 1;",
        "return null;",
        "return undefined;",
        "return [m];",
        "return 'text';",
        "return {data: m.data, toJSON: function(){ return undefined; }};",
        "return {data: m.data, attributes: {k: '\\udc00'}};",
        "return {get data(){ throw new Error('getter'); }};",
        "return f;",
    ]
)
_DATA = st.one_of(
    st.sampled_from(["", "a" * 200_000, "abcd😀xyz", "😀" * 10, '{"a": 1}']),
    st.text(max_size=30),
).map(lambda text: text.encode())


def examples(count: int) -> Any:
    """Hypothesis settings: ``count`` examples (times HEDGEPUB_TRUST_EXAMPLES)."""
    return settings(
        max_examples=count * SCALE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(in_memory=True) as local:
        yield local


@pytest.fixture(scope="module")
def rpc(server: LocalServer) -> Iterator[Rpc]:
    channel = Rpc(server.address)
    channel.call("Publisher", "CreateTopic", Topic(name=PROBE), Topic)
    yield channel
    channel.close()


def _code(top: str, statements: list[str]) -> str:
    return f"{top}\nfunction f(m, md) {{\n  {' '.join(statements)}\n  return m;\n}}"


def _still_serving(rpc: Rpc) -> None:
    assert rpc.call("Publisher", "GetTopic", GetTopicRequest(topic=PROBE), Topic).name == PROBE


@examples(40)
@given(top=_TOP_LEVEL, statements=st.lists(_STATEMENTS, max_size=4), data=_DATA)
def test_udfs_on_a_topic(rpc: Rpc, top: str, statements: list[str], data: bytes) -> None:
    """CreateTopic: OK or INVALID_ARGUMENT; Publish: OK or INVALID_ARGUMENT; the server serves on."""
    name = "projects/fuzz-udf/topics/fuzzed"
    transform = {"javascript_udf": {"code": _code(top, statements), "function_name": "f"}}
    try:
        rpc.call(
            "Publisher", "CreateTopic", Topic(name=name, message_transforms=[transform]), Topic, timeout=60
        )
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        _still_serving(rpc)
        return
    try:
        request = PublishRequest(topic=name, messages=[{"data": data or b"x"}, {"data": b"next"}])
        rpc.call("Publisher", "Publish", request, PublishResponse, timeout=60)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert len(error.details() or "") < 2000
    finally:
        rpc.call("Publisher", "DeleteTopic", DeleteTopicRequest(topic=name), Empty)
    _still_serving(rpc)


@examples(40)
@given(top=_TOP_LEVEL, statements=st.lists(_STATEMENTS, max_size=4), data=_DATA)
def test_udfs_in_test_message_transforms(
    server: LocalServer, rpc: Rpc, top: str, statements: list[str], data: bytes
) -> None:
    """``:testMessageTransforms``: 200 with each step's result, or 400; never a 500."""
    body = {
        "message": {"data": base64.b64encode(data).decode()},
        "messageTransforms": {
            "messageTransforms": [{"javascriptUdf": {"code": _code(top, statements), "functionName": "f"}}]
        },
    }
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/projects/fuzz-udf:testMessageTransforms", body=json.dumps(body).encode()
        )
        response = connection.getresponse()
        status, document = response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()
    assert status in (200, 400), document
    if status == 400:
        assert document["error"]["status"] == "INVALID_ARGUMENT", document
    _still_serving(rpc)
