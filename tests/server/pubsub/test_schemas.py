"""SchemaService through the official client, and topics that validate what is published against a schema."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import fastavro
import grpc.aio
import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.protobuf import descriptor_pb2
from google.pubsub_v1.types import CreateSchemaRequest, Encoding, Schema, SchemaView

from hedgepub.server import LocalServer
from hedgepub.server._pubsub.limits import MAX_SCHEMAS_PER_PROJECT

PROJECT = "projects/schema-project"

AVRO_DEFINITION = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "product", "type": "string"},
            {"name": "quantity", "type": "int"},
            {"name": "note", "type": ["null", "string"], "default": None},
        ],
    }
)
PROTO_DEFINITION = """
syntax = "proto3";
package shop;
message Order {
  string product = 1;
  int32 quantity = 2;
  repeated string tags = 3;
}
"""

GOOD_AVRO_JSON = b'{"product": "tea", "quantity": 3, "note": null}'
GOOD_PROTO_JSON = b'{"product": "tea", "quantity": 3, "tags": ["green"]}'


def _avro_binary(record: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(json.loads(AVRO_DEFINITION)), record)
    return buffer.getvalue()


def _proto_binary(product: str, quantity: int) -> bytes:
    """A shop.Order in the wire format, built from a descriptor (no generated code for the test schema)."""
    from google.protobuf import descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="order_test.proto", package="shop_test", syntax="proto3")
    message = file.message_type.add(name="Order")
    message.field.add(name="product", number=1, type=9, label=1)
    message.field.add(name="quantity", number=2, type=5, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    order_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("shop_test.Order"))
    return order_class(product=product, quantity=quantity).SerializeToString()


@pytest.fixture
def schema_client(server: LocalServer) -> Iterator[pubsub_v1.SchemaServiceClient]:
    """The official SchemaService client against the server (PUBSUB_EMULATOR_HOST is set)."""
    yield pubsub_v1.SchemaServiceClient()


def _create(client: pubsub_v1.SchemaServiceClient, schema_id: str, kind: Any, definition: str) -> Any:
    return client.create_schema(
        parent=PROJECT, schema=Schema(type_=kind, definition=definition), schema_id=schema_id
    )


def test_schema_lifecycle_with_revisions(schema_client: pubsub_v1.SchemaServiceClient) -> None:
    client = schema_client
    created = _create(client, "orders-avro", Schema.Type.AVRO, AVRO_DEFINITION)
    name = f"{PROJECT}/schemas/orders-avro"
    assert created.name == name
    assert len(created.revision_id) == 8
    int(created.revision_id, 16)
    assert created.revision_create_time.timestamp() > 0
    with pytest.raises(exceptions.AlreadyExists):
        _create(client, "orders-avro", Schema.Type.AVRO, AVRO_DEFINITION)

    full = client.get_schema(name=name)  # no view: every field, as the real service answers
    assert full.definition == AVRO_DEFINITION
    basic = client.get_schema(request={"name": name, "view": SchemaView.BASIC})
    assert basic.definition == "" and basic.type_ == Schema.Type.AVRO and basic.revision_id

    changed = AVRO_DEFINITION.replace('"quantity"', '"count"')
    second = client.commit_schema(name=name, schema=Schema(type_=Schema.Type.AVRO, definition=changed))
    assert second.revision_id != created.revision_id
    assert client.get_schema(name=name).definition == changed
    old = client.get_schema(name=f"{name}@{created.revision_id}")
    assert old.definition == AVRO_DEFINITION

    revisions = list(client.list_schema_revisions(request={"name": name, "view": SchemaView.FULL}))
    assert [r.revision_id for r in revisions] == [created.revision_id, second.revision_id]
    assert revisions[0].revision_create_time < revisions[1].revision_create_time

    rolled = client.rollback_schema(name=name, revision_id=created.revision_id)
    assert rolled.definition == AVRO_DEFINITION
    assert rolled.revision_id not in {created.revision_id, second.revision_id}
    with pytest.raises(exceptions.NotFound):
        client.rollback_schema(name=name, revision_id="0badf00d")

    deleted = client.delete_schema_revision(name=f"{name}@{second.revision_id}")
    assert deleted.revision_id == second.revision_id
    with pytest.raises(exceptions.NotFound):
        client.get_schema(name=f"{name}@{second.revision_id}")
    assert len(list(client.list_schema_revisions(name=name))) == 2

    _create(client, "orders-proto", Schema.Type.PROTOCOL_BUFFER, PROTO_DEFINITION)
    listed = list(client.list_schemas(parent=PROJECT))  # no view: BASIC, no definitions
    assert [schema.name for schema in listed] == [name, f"{PROJECT}/schemas/orders-proto"]
    assert all(schema.definition == "" for schema in listed)
    listed = list(client.list_schemas(request={"parent": PROJECT, "view": SchemaView.FULL}))
    assert listed[1].definition == PROTO_DEFINITION
    paged = client.list_schemas(request={"parent": PROJECT, "page_size": 1})
    assert len(list(paged)) == 2

    client.delete_schema(name=name)
    with pytest.raises(exceptions.NotFound):
        client.get_schema(name=name)
    with pytest.raises(exceptions.NotFound):
        client.delete_schema(name=name)


def test_last_revision_cannot_be_deleted(schema_client: pubsub_v1.SchemaServiceClient) -> None:
    created = _create(schema_client, "single", Schema.Type.AVRO, AVRO_DEFINITION)
    with pytest.raises(exceptions.InvalidArgument, match="Cannot delete last revision"):
        schema_client.delete_schema_revision(name=f"{created.name}@{created.revision_id}")


@pytest.mark.parametrize(
    ("kind", "definition", "words"),
    [
        (Schema.Type.AVRO, '{"type": "record"', "not JSON"),
        (Schema.Type.AVRO, '{"type": "recrod", "name": "x"}', "Could not parse schema definition"),
        (Schema.Type.PROTOCOL_BUFFER, "message {", "line 1"),
        (
            Schema.Type.PROTOCOL_BUFFER,
            'syntax = "proto3"; message A { int32 a = 1; } message B { int32 b = 1; }',
            "exactly one top-level type",
        ),
        (
            Schema.Type.PROTOCOL_BUFFER,
            'syntax = "proto3"; message A { int32 a = 1; int32 b = 1; }',
            "already been used",
        ),
        (Schema.Type.TYPE_UNSPECIFIED, AVRO_DEFINITION, "Invalid schema type"),
    ],
)
def test_bad_definitions_are_refused(
    schema_client: pubsub_v1.SchemaServiceClient, kind: Any, definition: str, words: str
) -> None:
    with pytest.raises(exceptions.InvalidArgument, match=words):
        schema_client.validate_schema(parent=PROJECT, schema=Schema(type_=kind, definition=definition))
    with pytest.raises(exceptions.InvalidArgument, match=words):
        _create(schema_client, "refused", kind, definition)
    assert list(schema_client.list_schemas(parent=PROJECT)) == []


def test_compiled_proto_schema(schema_client: pubsub_v1.SchemaServiceClient) -> None:
    """A schema given as a compiled FileDescriptorSet and its root message, not as text."""
    file = descriptor_pb2.FileDescriptorProto(name="ping.proto", package="net", syntax="proto3")
    file.message_type.add(name="Ping").field.add(name="id", number=1, type=3, label=1)
    compiled = descriptor_pb2.FileDescriptorSet(file=[file]).SerializeToString()
    schema = Schema(
        type_=Schema.Type.PROTOCOL_BUFFER,
        compiled_proto_schema={"root_message": "net.Ping", "compiled_bytes": compiled},
    )
    schema_client.validate_message(
        request={"parent": PROJECT, "schema": schema, "message": b'{"id": "7"}', "encoding": Encoding.JSON}
    )
    with pytest.raises(exceptions.InvalidArgument):
        schema_client.validate_message(
            request={
                "parent": PROJECT,
                "schema": schema,
                "message": b'{"nope": 1}',
                "encoding": Encoding.JSON,
            }
        )


# (schema type, definition, a good message per encoding, bad messages per encoding)
CASES = {
    "avro": (
        Schema.Type.AVRO,
        AVRO_DEFINITION,
        {
            Encoding.JSON: GOOD_AVRO_JSON,
            Encoding.BINARY: _avro_binary({"product": "tea", "quantity": 3, "note": "hot"}),
        },
        {
            Encoding.JSON: [
                b'{"product": "tea", "quantity": "three", "note": null}',  # wrong type
                b'{"product": "tea", "note": null}',  # a field missing
                b"not json",
            ],
            Encoding.BINARY: [
                b"\x06tea",  # cut short
                _avro_binary({"product": "tea", "quantity": 3, "note": None}) + b"\x00",  # trailing data
            ],
        },
    ),
    "proto": (
        Schema.Type.PROTOCOL_BUFFER,
        PROTO_DEFINITION,
        {Encoding.JSON: GOOD_PROTO_JSON, Encoding.BINARY: _proto_binary("tea", 3)},
        {
            Encoding.JSON: [b'{"product": 5}', b'{"colour": "red"}', b"[]"],
            Encoding.BINARY: [b"\xff\xff\xff", b"\x0a\x05te"],
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("encoding", [Encoding.JSON, Encoding.BINARY], ids=["json", "binary"])
def test_topic_refuses_bad_messages_and_stamps_good_ones(
    server: LocalServer,
    schema_client: pubsub_v1.SchemaServiceClient,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    case: str,
    encoding: Any,
) -> None:
    kind, definition, good, bad = CASES[case]
    schema = _create(schema_client, f"{case}-schema", kind, definition)
    topic = f"{PROJECT}/topics/{case}-topic"
    publisher.create_topic(
        request={"name": topic, "schema_settings": {"schema": schema.name, "encoding": encoding}}
    )
    subscription = f"{PROJECT}/subscriptions/{case}-sub"
    subscriber.create_subscription(name=subscription, topic=topic)

    for message in bad[encoding]:
        with pytest.raises(exceptions.InvalidArgument) as caught:
            publisher.publish(topic, message).result(timeout=30)
        assert "Message failed schema validation" in str(caught.value)
        assert schema.name in str(caught.value)
        assert schema.revision_id in str(caught.value)
        with pytest.raises(exceptions.InvalidArgument, match="Message failed schema validation"):
            schema_client.validate_message(
                request={"parent": PROJECT, "name": schema.name, "message": message, "encoding": encoding}
            )

    schema_client.validate_message(
        request={"parent": PROJECT, "name": schema.name, "message": good[encoding], "encoding": encoding}
    )
    publisher.publish(topic, good[encoding], origin="test").result(timeout=30)
    pulled = subscriber.pull(subscription=subscription, max_messages=10, timeout=30).received_messages
    assert len(pulled) == 1
    message = pulled[0].message
    assert message.data == good[encoding]
    assert dict(message.attributes) == {
        "origin": "test",
        "googclient_schemaname": schema.name,
        "googclient_schemaencoding": Encoding(encoding).name,
        "googclient_schemarevisionid": schema.revision_id,
    }


def test_schema_settings_are_checked(
    schema_client: pubsub_v1.SchemaServiceClient, publisher: pubsub_v1.PublisherClient
) -> None:
    first = _create(schema_client, "ranged", Schema.Type.AVRO, AVRO_DEFINITION)
    renamed = AVRO_DEFINITION.replace('"quantity"', '"count"')
    second = schema_client.commit_schema(
        name=first.name, schema=Schema(type_=Schema.Type.AVRO, definition=renamed)
    )

    def create(**settings: Any) -> Any:
        return publisher.create_topic(
            request={"name": f"{PROJECT}/topics/ranged", "schema_settings": settings}
        )

    with pytest.raises(exceptions.NotFound, match="Schema could not be found"):
        create(schema=f"{PROJECT}/schemas/missing", encoding=Encoding.JSON)
    with pytest.raises(exceptions.InvalidArgument, match="encoding"):
        create(schema=first.name)
    with pytest.raises(exceptions.NotFound, match="First revision"):
        create(schema=first.name, encoding=Encoding.JSON, first_revision_id="0badf00d")
    with pytest.raises(exceptions.NotFound, match="Last revision"):
        create(schema=first.name, encoding=Encoding.JSON, last_revision_id="0badf00d")
    with pytest.raises(exceptions.InvalidArgument, match="after last revision"):
        create(
            schema=first.name,
            encoding=Encoding.JSON,
            first_revision_id=second.revision_id,
            last_revision_id=first.revision_id,
        )

    # Any revision: a message of either shape goes, stamped with the revision that accepted it.
    topic = create(schema=first.name, encoding=Encoding.JSON).name
    old_shape = b'{"product": "tea", "quantity": 1, "note": null}'
    new_shape = b'{"product": "tea", "count": 1, "note": null}'
    publisher.publish(topic, old_shape).result(timeout=30)
    publisher.publish(topic, new_shape).result(timeout=30)
    # Only the newest revision: the old shape is refused, naming the revision it was checked against.
    publisher.update_topic(
        request={
            "topic": {
                "name": topic,
                "schema_settings": {
                    "schema": first.name,
                    "encoding": Encoding.JSON,
                    "first_revision_id": second.revision_id,
                },
            },
            "update_mask": {"paths": ["schema_settings"]},
        }
    )
    with pytest.raises(exceptions.InvalidArgument, match=f"revision_id={second.revision_id}"):
        publisher.publish(topic, old_shape).result(timeout=30)
    publisher.publish(topic, new_shape).result(timeout=30)
    with pytest.raises(exceptions.NotFound):
        publisher.update_topic(
            request={
                "topic": {"name": topic, "schema_settings": {"schema": f"{PROJECT}/schemas/gone"}},
                "update_mask": {"paths": ["schema_settings"]},
            }
        )

    # Deleting the schema leaves the topic naming _deleted-schema_, and publishing fails.
    schema_client.delete_schema(name=first.name)
    assert publisher.get_topic(topic=topic).schema_settings.schema == "_deleted-schema_"
    with pytest.raises(exceptions.NotFound, match="Schema associated with topic deleted"):
        publisher.publish(topic, new_shape).result(timeout=30)


def test_schemas_survive_a_restart(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    with LocalServer(data_dir=data) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        client = pubsub_v1.SchemaServiceClient()
        first = _create(client, "durable", Schema.Type.PROTOCOL_BUFFER, PROTO_DEFINITION)
        second = client.commit_schema(
            name=first.name,
            schema=Schema(type_=Schema.Type.PROTOCOL_BUFFER, definition=PROTO_DEFINITION + "\n// v2\n"),
        )
        publisher = pubsub_v1.PublisherClient()
        topic = f"{PROJECT}/topics/durable"
        publisher.create_topic(
            request={"name": topic, "schema_settings": {"schema": first.name, "encoding": Encoding.JSON}}
        )
    with LocalServer(data_dir=data) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        client = pubsub_v1.SchemaServiceClient()
        revisions = list(client.list_schema_revisions(request={"name": first.name, "view": SchemaView.FULL}))
        assert [(r.revision_id, r.definition) for r in revisions] == [
            (first.revision_id, first.definition),
            (second.revision_id, second.definition),
        ]
        assert revisions[0].revision_create_time == first.revision_create_time
        publisher = pubsub_v1.PublisherClient()
        with pytest.raises(exceptions.InvalidArgument):
            publisher.publish(topic, b'{"product": 1}').result(timeout=30)
        publisher.publish(topic, GOOD_PROTO_JSON).result(timeout=30)
        stored = local.messages(topic)
        assert stored[0].attributes["googclient_schemarevisionid"] == second.revision_id


async def _create_schemas(address: str, parent: str, count: int, definition: str) -> None:
    """Create ``count`` Avro schemas over raw gRPC, many calls in flight (the quota test needs 10,000)."""
    request_class = CreateSchemaRequest.pb()
    async with grpc.aio.insecure_channel(address) as channel:
        create = channel.unary_unary(
            "/google.pubsub.v1.SchemaService/CreateSchema",
            request_serializer=lambda request: request.SerializeToString(),
            response_deserializer=Schema.pb().FromString,
        )
        schema = Schema.pb()(type_=Schema.Type.AVRO, definition=definition)
        numbers = iter(range(count))

        async def worker() -> None:
            for number in numbers:
                await create(request_class(parent=parent, schema_id=f"filler-{number:05d}", schema=schema))

        await asyncio.gather(*(worker() for _ in range(32)))


def test_a_project_holds_at_most_its_quota_of_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_SCHEMAS_PER_PROJECT == 10_000  # the real service's documented quota, created in full here
    with LocalServer(in_memory=True) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        asyncio.run(_create_schemas(local.address, PROJECT, MAX_SCHEMAS_PER_PROJECT, AVRO_DEFINITION))
        client = pubsub_v1.SchemaServiceClient()
        with pytest.raises(exceptions.ResourceExhausted) as refused:
            _create(client, "one-too-many", Schema.Type.AVRO, AVRO_DEFINITION)
        assert refused.value.message == (
            f"The project {PROJECT} already has 10000 schemas, the most a project may have. "
            "Delete a schema before creating another."
        )
        # The quota counts schemas, not revisions, and each project has its own.
        full = f"{PROJECT}/schemas/filler-00000"
        client.commit_schema(name=full, schema=Schema(type_=Schema.Type.AVRO, definition=AVRO_DEFINITION))
        other = client.create_schema(
            parent="projects/other-project",
            schema=Schema(type_=Schema.Type.AVRO, definition=AVRO_DEFINITION),
            schema_id="one-too-many",
        )
        assert other.name == "projects/other-project/schemas/one-too-many"
        # Deleting a schema makes room for one more.
        client.delete_schema(name=full)
        assert _create(client, "one-too-many", Schema.Type.AVRO, AVRO_DEFINITION).name == (
            f"{PROJECT}/schemas/one-too-many"
        )
        with pytest.raises(exceptions.ResourceExhausted):
            _create(client, "two-too-many", Schema.Type.AVRO, AVRO_DEFINITION)
