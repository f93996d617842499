"""What schema validation costs per schema kind, and whether a costly one holds up other calls.

``hedgepub serve --in-memory`` in a subprocess; a topic per kind: none, Avro (JSON and binary encoding) and
Protocol Buffer (JSON and binary), each message a record of five fields (string, long, double, boolean,
array of strings). Four concurrent raw-gRPC publishers send ``--messages`` messages, ``--batch`` per
Publish, to each topic in turn (the order alternating between rounds); the summary prints messages/s as
median [min-max] over the rounds, and each kind's ratio to no schema.

Then the costly case: a schema of 20 revisions of which only the oldest accepts the messages, one Publish
of 1,000 JSON messages, and meanwhile a GetTopic every 10 ms on another channel: the Publish's time and
the slowest GetTopic while it ran (with validation on the event loop, every other call waited for the
whole Publish).

    python benchmarks/schema_validation.py
    python benchmarks/schema_validation.py --rounds 5 --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from typing import Any

import fastavro
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.pubsub_v1.types import pubsub, schema

from hedgepub.server._pubsub.schema_formats import compile_proto
from server_ingest import ServerProcess, load_average, spread

PROJECT = "projects/schema-bench"
AVRO_RECORD = {
    "type": "record",
    "name": "Event",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "count", "type": "long"},
        {"name": "score", "type": "double"},
        {"name": "ok", "type": "boolean"},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
}
PROTO = (
    'syntax = "proto3"; message Event { string id = 1; int64 count = 2; double score = 3; bool ok = 4; '
    "repeated string tags = 5; }"
)
VALUE = {"id": "event-0001", "count": 42, "score": 0.5, "ok": True, "tags": ["a", "b", "c"]}
KINDS = ["none", "avro-json", "avro-binary", "proto-json", "proto-binary"]

Topic = pubsub.Topic.pb()
PublishRequest = pubsub.PublishRequest.pb()
GetTopicRequest = pubsub.GetTopicRequest.pb()
Schema = schema.Schema.pb()
CreateSchemaRequest = schema.CreateSchemaRequest.pb()
CommitSchemaRequest = schema.CommitSchemaRequest.pb()


def _proto_class() -> Any:
    files = descriptor_pb2.FileDescriptorSet.FromString(compile_proto(PROTO))
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("Event"))


def message_data(kind: str) -> bytes:
    """One message's data in the kind's encoding."""
    if kind in ("none", "avro-json", "proto-json"):
        return json.dumps(VALUE).encode()
    if kind == "avro-binary":
        out = io.BytesIO()
        fastavro.schemaless_writer(out, fastavro.parse_schema(AVRO_RECORD), VALUE)
        return out.getvalue()
    return _proto_class()(**VALUE).SerializeToString()


async def _call(channel: grpc.aio.Channel, service: str, method: str, request: Any) -> bytes:
    return await channel.unary_unary(f"/google.pubsub.v1.{service}/{method}")(
        request.SerializeToString(), timeout=120
    )


async def set_up(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        for kind, definition, schema_type in (
            ("avro", json.dumps(AVRO_RECORD), schema.Schema.Type.AVRO),
            ("proto", PROTO, schema.Schema.Type.PROTOCOL_BUFFER),
        ):
            body = Schema(type_=schema_type, definition=definition)
            await _call(
                channel, "SchemaService", "CreateSchema",
                CreateSchemaRequest(parent=PROJECT, schema_id=kind, schema=body),
            )  # fmt: skip
        for kind in KINDS:
            topic = Topic(name=f"{PROJECT}/topics/{kind}")
            if kind != "none":
                family, encoding = kind.split("-")
                topic.schema_settings.schema = f"{PROJECT}/schemas/{family}"
                topic.schema_settings.encoding = (
                    schema.Encoding.JSON if encoding == "json" else schema.Encoding.BINARY
                )
            await _call(channel, "Publisher", "CreateTopic", topic)


async def publish_rate(address: str, kind: str, messages: int, batch: int) -> float:
    request = PublishRequest(
        topic=f"{PROJECT}/topics/{kind}", messages=[{"data": message_data(kind)} for _ in range(batch)]
    ).SerializeToString()
    async with grpc.aio.insecure_channel(address) as channel:
        publish = channel.unary_unary("/google.pubsub.v1.Publisher/Publish")
        await publish(request, timeout=120)
        remaining = messages // batch

        async def publisher() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await publish(request, timeout=120)

        started = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(4)))
        return messages / (time.perf_counter() - started)


async def costly(address: str) -> tuple[float, float]:
    """The 20-revision case: (seconds of the Publish, slowest GetTopic in ms while it ran)."""
    name = f"{PROJECT}/schemas/many"
    async with grpc.aio.insecure_channel(address) as channel:
        first = Schema(type_=schema.Schema.Type.AVRO, definition=json.dumps(AVRO_RECORD))
        await _call(
            channel,
            "SchemaService",
            "CreateSchema",
            CreateSchemaRequest(parent=PROJECT, schema_id="many", schema=first),
        )
        for index in range(19):
            other = {**AVRO_RECORD, "fields": [{"name": f"other{index}", "type": "string"}]}
            body = Schema(type_=schema.Schema.Type.AVRO, definition=json.dumps(other))
            await _call(channel, "SchemaService", "CommitSchema", CommitSchemaRequest(name=name, schema=body))
        topic = Topic(name=f"{PROJECT}/topics/many")
        topic.schema_settings.schema = name
        topic.schema_settings.encoding = schema.Encoding.JSON
        await _call(channel, "Publisher", "CreateTopic", topic)
        request = PublishRequest(topic=topic.name, messages=[{"data": message_data("avro-json")}] * 1000)
        slowest = 0.0
        async with grpc.aio.insecure_channel(address) as other_channel:
            get = other_channel.unary_unary("/google.pubsub.v1.Publisher/GetTopic")
            await get(GetTopicRequest(topic=topic.name).SerializeToString(), timeout=60)
            started = time.perf_counter()
            publishing = asyncio.ensure_future(_call(channel, "Publisher", "Publish", request))
            while not publishing.done():
                sent = time.perf_counter()
                await get(GetTopicRequest(topic=topic.name).SerializeToString(), timeout=60)
                slowest = max(slowest, time.perf_counter() - sent)
                await asyncio.sleep(0.01)
            await publishing
            return time.perf_counter() - started, slowest * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    print(f"load average before: {load_average()}")
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    costly_runs: list[tuple[float, float]] = []
    for round_number in range(args.rounds):
        server = ServerProcess("memory")
        server.start()
        try:
            asyncio.run(set_up(server.address))
            order = KINDS if round_number % 2 == 0 else KINDS[::-1]
            for kind in order:
                rate = asyncio.run(publish_rate(server.address, kind, args.messages, args.batch))
                rates[kind].append(rate)
                print(f"round {round_number + 1}: {kind:<13} {rate:,.0f} msg/s", flush=True)
            costly_runs.append(asyncio.run(costly(server.address)))
            print(
                f"round {round_number + 1}: 20 revisions, 1,000 JSON messages: "
                f"Publish {costly_runs[-1][0]:.2f} s, slowest GetTopic then {costly_runs[-1][1]:,.0f} ms",
                flush=True,
            )
        finally:
            server.stop()
    baseline = statistics.median(rates["none"])
    print("summary (median [min-max] over rounds):")
    for kind in KINDS:
        ratio = statistics.median(rates[kind]) / baseline
        print(f"  {kind:<13} {spread(rates[kind])} msg/s  {ratio:.2f}x of no schema")
    print(
        f"  20 revisions: Publish {spread([run[0] for run in costly_runs], '.2f')} s, slowest GetTopic "
        f"{spread([run[1] for run in costly_runs], ',.0f')} ms"
    )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
