"""Schemas under hostile input, against ``hedgepub serve`` in a subprocess (a crash in C code would end
it without a traceback): deep and recursive definitions and messages are INVALID_ARGUMENT, never a
crash or INTERNAL; and a costly validation does not hold up other calls.

A fuzz draws Avro definitions (JSON pieces: records, unions, arrays, maps, self-references, nesting up to
far past the bound) and messages against an Avro schema that refers to itself and against a protobuf
schema (random and nested bytes, nested JSON), through ValidateSchema and ValidateMessage: every answer
is OK or INVALID_ARGUMENT, and the server stays up. ``HEDGEPUB_TRUST_EXAMPLES`` multiplies the cases.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.pubsub_v1.types import pubsub as pubsub_types
from google.pubsub_v1.types import schema as schema_types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Rpc, ServerProcess

SCALE = int(os.environ.get("HEDGEPUB_TRUST_EXAMPLES", "") or 1)
PROJECT = "projects/hostile"
Schema = schema_types.Schema.pb()
ValidateSchemaRequest = schema_types.ValidateSchemaRequest.pb()
ValidateMessageRequest = schema_types.ValidateMessageRequest.pb()
ValidateMessageResponse = schema_types.ValidateMessageResponse.pb()
ValidateSchemaResponse = schema_types.ValidateSchemaResponse.pb()
CreateSchemaRequest = schema_types.CreateSchemaRequest.pb()
Topic = pubsub_types.Topic.pb()
PublishRequest = pubsub_types.PublishRequest.pb()
PublishResponse = pubsub_types.PublishResponse.pb()
GetTopicRequest = pubsub_types.GetTopicRequest.pb()
AVRO, PROTO = schema_types.Schema.Type.AVRO, schema_types.Schema.Type.PROTOCOL_BUFFER
JSON, BINARY = schema_types.Encoding.JSON, schema_types.Encoding.BINARY

LINKED = json.dumps({"type": "record", "name": "N", "fields": [{"name": "next", "type": ["null", "N"]}]})
PROTO_DEFINITION = (
    'syntax = "proto3"; message Node { string label = 1; Node next = 2; repeated Node more = 3; }'
)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from .conftest import free_port

    directory = tmp_path_factory.mktemp("hostile-schemas")
    server = ServerProcess(free_port(), directory / "data", directory / "server.log", in_memory=True)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def rpc(serve: ServerProcess) -> Iterator[Rpc]:
    client = Rpc(serve.address)
    yield client
    client.close()


def _answer(rpc: Rpc, method: str, request: Any, response_class: Any, service: str = "SchemaService") -> Any:
    try:
        rpc.call(service, method, request, response_class, timeout=60)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _alive(serve: ServerProcess) -> None:
    assert serve.process is not None and serve.process.poll() is None, f"server died:\n{serve.log()}"


def _validate_schema(rpc: Rpc, kind: int, definition: str) -> tuple[grpc.StatusCode, str]:
    request = ValidateSchemaRequest(parent=PROJECT, schema=Schema(type_=kind, definition=definition))
    return _answer(rpc, "ValidateSchema", request, ValidateSchemaResponse)


def _validate_message(
    rpc: Rpc, kind: int, definition: str, message: bytes, encoding: int
) -> tuple[grpc.StatusCode, str]:
    request = ValidateMessageRequest(
        parent=PROJECT, schema=Schema(type_=kind, definition=definition), message=message, encoding=encoding
    )
    return _answer(rpc, "ValidateMessage", request, ValidateMessageResponse)


def _nested_records(depth: int) -> str:
    """``depth`` records each holding the next (built as text: json.dumps itself would recurse)."""
    opening = "".join(
        f'{{"type": "record", "name": "R{level}", "fields": [{{"name": "f", "type": '
        for level in range(depth)
    )
    return opening + '"long"' + "}]}" * depth


@pytest.mark.parametrize(
    ("kind", "definition"),
    [
        (AVRO, "[" * 100_000),
        (AVRO, "{" * 100_000),
        (AVRO, _nested_records(2_000)),
        (AVRO, json.dumps({"type": "array", "items": "long"}) * 1 + "[" * 50_000),
    ],
    ids=["100k-brackets", "100k-braces", "2000-records", "tail-of-brackets"],
)
def test_a_deep_definition_is_invalid_argument(
    serve: ServerProcess, rpc: Rpc, kind: int, definition: str
) -> None:
    code, details = _validate_schema(rpc, kind, definition)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    _alive(serve)


def test_nested_records_within_the_bound_are_taken(rpc: Rpc) -> None:
    assert _validate_schema(rpc, AVRO, _nested_records(30))[0] == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("kind", "definition", "message", "encoding"),
    [
        (AVRO, LINKED, b"\x02" * 10_000 + b"\x00", BINARY),  # the crash reported: a segfault, exit -11
        (AVRO, LINKED, b"\x02" * 1_000_000, BINARY),
        (AVRO, LINKED, b'{"next": {"N": ' * 50_000 + b"null" + b"}}" * 50_000, JSON),
        (AVRO, LINKED, b"[" * 100_000, JSON),
        (PROTO, PROTO_DEFINITION, b'{"next": ' * 100_000 + b"{}" + b"}" * 100_000, JSON),
    ],
    ids=["avro-binary-10k", "avro-binary-1m", "avro-json-50k", "avro-json-brackets", "proto-json-100k"],
)  # fmt: skip
def test_a_deep_message_is_invalid_argument_not_a_crash(
    serve: ServerProcess, rpc: Rpc, kind: int, definition: str, message: bytes, encoding: int
) -> None:
    code, details = _validate_message(rpc, kind, definition, message, encoding)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    _alive(serve)


def _proto_nested_binary(depth: int) -> bytes:
    """A Node nested ``depth`` deep through field 2 (``next``), in the binary encoding."""
    inner = b""
    for _ in range(depth):
        inner = b"\x12" + _varint(len(inner)) + inner
    return inner


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_a_deep_protobuf_binary_message_is_invalid_argument(serve: ServerProcess, rpc: Rpc) -> None:
    code, _ = _validate_message(rpc, PROTO, PROTO_DEFINITION, _proto_nested_binary(50), BINARY)
    assert code == grpc.StatusCode.OK
    code, details = _validate_message(rpc, PROTO, PROTO_DEFINITION, _proto_nested_binary(5_000), BINARY)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    _alive(serve)


_UNION_AND_ENUM = json.dumps(
    {
        "type": "record",
        "name": "Choice",
        "fields": [
            {"name": "maybe", "type": ["null", "long"]},
            {"name": "colour", "type": {"type": "enum", "name": "Colour", "symbols": ["RED", "GREEN"]}},
        ],
    }
)


@pytest.mark.parametrize(
    ("definition", "message"),
    [
        # A union index of -1 (zigzag b"\x01") over and over: Avro's reader took it as the last branch,
        # the recursive one, and recursed in C until the server's process died (SIGSEGV).
        (LINKED, b"\x01" * 5_000),
        (LINKED, b"\x02" * 3 + b"\x01"),
        # Negative or too large indexes in a schema without recursion: refused, not read as another branch.
        (_UNION_AND_ENUM, b"\x01" + b"\x00"),
        (_UNION_AND_ENUM, b"\x04" + b"\x00"),
        (_UNION_AND_ENUM, b"\x00" + b"\x01"),
        (_UNION_AND_ENUM, b"\x00" + b"\x04"),
    ],
)
def test_a_union_branch_or_enum_symbol_out_of_range_is_invalid_argument(
    serve: ServerProcess, rpc: Rpc, definition: str, message: bytes
) -> None:
    code, details = _validate_message(rpc, AVRO, definition, message, BINARY)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    _alive(serve)
    # In range, the same schemas take the message.
    good = b"\x02" * 3 + b"\x00" if definition == LINKED else b"\x02\x06" + b"\x02"
    assert _validate_message(rpc, AVRO, definition, good, BINARY)[0] == grpc.StatusCode.OK


def test_publishing_a_deep_message_to_a_recursive_schema_topic_is_refused(
    serve: ServerProcess, rpc: Rpc
) -> None:
    schema = f"{PROJECT}/schemas/linked"
    rpc.call(
        "SchemaService", "CreateSchema",
        CreateSchemaRequest(parent=PROJECT, schema_id="linked", schema=Schema(type_=AVRO, definition=LINKED)),
        Schema,
    )  # fmt: skip
    topic = f"{PROJECT}/topics/linked"
    rpc.call(
        "Publisher",
        "CreateTopic",
        Topic(name=topic, schema_settings={"schema": schema, "encoding": BINARY}),
        Topic,
    )
    request = PublishRequest(topic=topic, messages=[{"data": b"\x02" * 10_000 + b"\x00"}])
    code, details = _answer(rpc, "Publish", request, PublishResponse, service="Publisher")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    request = PublishRequest(topic=topic, messages=[{"data": b"\x02" * 20 + b"\x00"}])
    assert _answer(rpc, "Publish", request, PublishResponse, service="Publisher")[0] == grpc.StatusCode.OK
    _alive(serve)


def test_a_costly_validation_does_not_hold_up_other_calls(serve: ServerProcess, rpc: Rpc) -> None:
    """A schema of 20 revisions where only the oldest accepts, and a Publish of 1,000 JSON messages: other
    calls are answered while it is checked, not after."""
    schema = f"{PROJECT}/schemas/many-revisions"
    record = {"type": "record", "name": "Event", "fields": [{"name": "n", "type": "long"}]}
    first = Schema(type_=AVRO, definition=json.dumps(record))
    create = CreateSchemaRequest(parent=PROJECT, schema_id="many-revisions", schema=first)
    rpc.call("SchemaService", "CreateSchema", create, Schema)
    for index in range(19):
        newer = {**record, "fields": [{"name": f"other{index}", "type": "string"}]}
        commit = schema_types.CommitSchemaRequest.pb()(
            name=schema, schema=Schema(type_=AVRO, definition=json.dumps(newer))
        )
        rpc.call("SchemaService", "CommitSchema", commit, Schema)
    topic = f"{PROJECT}/topics/many-revisions"
    rpc.call(
        "Publisher",
        "CreateTopic",
        Topic(name=topic, schema_settings={"schema": schema, "encoding": JSON}),
        Topic,
    )
    messages = [{"data": json.dumps({"n": index}).encode()} for index in range(1_000)]
    finished: dict[str, float] = {}

    def publish() -> None:
        rpc.call(
            "Publisher",
            "Publish",
            PublishRequest(topic=topic, messages=messages),
            PublishResponse,
            timeout=120,
        )
        finished["publish"] = time.monotonic()

    publisher = threading.Thread(target=publish)
    started = time.monotonic()
    publisher.start()
    time.sleep(0.05)
    other = Rpc(serve.address)
    try:
        other.call("Publisher", "GetTopic", GetTopicRequest(topic=topic), Topic)
        finished["get"] = time.monotonic()
    finally:
        other.close()
    publisher.join()
    publish_seconds, get_seconds = finished["publish"] - started, finished["get"] - started
    print(f"\npublish {publish_seconds:.2f} s, GetTopic answered after {get_seconds:.2f} s")
    assert finished["get"] < finished["publish"]


# ------------------------------------------------------------------------------------------- the fuzz
def examples(count: int) -> Any:
    return settings(
        max_examples=count * SCALE,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


_AVRO_PIECES = st.sampled_from(
    [
        '{"type": "record", "name": "R", "fields": [{"name": "a", "type": ',
        '{"type": "record", "name": "S", "fields": [',
        '{"name": "b", "type": "R"}',
        '{"type": "array", "items": ',
        '{"type": "map", "values": ',
        '["null", ',
        '"long"', '"R"', '"S"', '"string"', "]", "}", "]}", "}]}", ",", "[", "{", '"', "null", "1",
        '{"type": "enum", "name": "E", "symbols": ["A"]}',
        '{"type": "fixed", "name": "F", "size": 2}',
    ]
)  # fmt: skip


@examples(400)
@given(pieces=st.lists(_AVRO_PIECES, max_size=40), repeat=st.sampled_from([1, 1, 1, 50, 300]))
def test_fuzz_avro_definitions(serve: ServerProcess, rpc: Rpc, pieces: list[str], repeat: int) -> None:
    definition = "".join(pieces[:3]) * repeat + "".join(pieces[3:])
    if not definition:
        return
    code, details = _validate_schema(rpc, AVRO, definition)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)


_RECURSIVE = json.dumps(
    {
        "type": "record",
        "name": "Tree",
        "fields": [
            {"name": "label", "type": "string"},
            {"name": "children", "type": {"type": "array", "items": "Tree"}},
            {"name": "named", "type": {"type": "map", "values": ["null", "Tree"]}},
        ],
    }
)
_KEYS = st.sampled_from(["label", "children", "named", "next", "Tree", "x"])
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=20,
)


@examples(600)
@given(
    message=st.one_of(
        st.binary(max_size=300),
        st.tuples(
            st.sampled_from([b"\x02", b"\x00\x02", b"\x02\x02\x00", b"\x01", b"\x80\x80\x80\x80\x08"]),
            st.integers(1, 5000),
        ).map(lambda pair: pair[0] * pair[1]),
        _json_values.map(lambda value: json.dumps(value).encode()),
        st.tuples(
            st.sampled_from(['{"next": ', "[", '{"label": "x", "children": [', '{"Tree": ']),
            st.integers(1, 3000),
        ).map(lambda pair: (pair[0] * pair[1]).encode()),
    ),
    target=st.sampled_from([(AVRO, LINKED), (AVRO, _RECURSIVE), (PROTO, PROTO_DEFINITION)]),
    encoding=st.sampled_from([JSON, BINARY]),
)  # fmt: skip
def test_fuzz_messages_against_schemas(
    serve: ServerProcess, rpc: Rpc, message: bytes, target: tuple[int, str], encoding: int
) -> None:
    kind, definition = target
    code, details = _validate_message(rpc, kind, definition, message, encoding)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if serve.process is not None and serve.process.poll() is not None:
        pytest.fail(f"server died:\n{serve.log()}")
