"""The local server recognises any client's hedges by the ``x-goog-pubsub-client-telemetry`` header.

Raw gRPC publishes to a real server on an ephemeral port, each carrying the header as Google's Java, Go
and Rust clients send it: the standard base64 (no ``-bin`` key) of a serialized
``google.pubsub.v1.PubsubClientTelemetry`` built here from the client package's own class, not through
hedgepub's codec.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.pubsub_v1.types import PubsubClientTelemetry

from hedgepub.server import LocalServer

from ..._pb import PublishRequest, PublishResponse, PubsubMessage, Topic

TOPIC = "projects/telemetry/topics/orders"
HEADER = "x-goog-pubsub-client-telemetry"
#: The references' encodings (Rust's tests): attempt 0 and attempt 1, both without a start time.
ATTEMPT_0 = "CgA="
ATTEMPT_1 = "CgIIAQ=="


def telemetry(attempt: int, start_seconds: int | None, start_nanos: int = 0) -> str:
    """The header value of hedge ``attempt`` of a batch first sent at ``start_seconds``."""
    message: Any = PubsubClientTelemetry.pb()()
    operation = message.publish_operation
    operation.SetInParent()
    operation.hedged_attempt_count = attempt
    if start_seconds is not None:
        operation.publish_start_time.seconds = start_seconds
        operation.publish_start_time.nanos = start_nanos
    return base64.b64encode(message.SerializeToString()).decode()


class Raw:
    """Publish calls on one plain gRPC channel to ``server``."""

    def __init__(self, server: LocalServer) -> None:
        self.channel = grpc.insecure_channel(server.address)
        self._publish = self.channel.unary_unary(
            "/google.pubsub.v1.Publisher/Publish",
            request_serializer=PublishRequest.SerializeToString,
            response_deserializer=PublishResponse.FromString,
        )
        self.channel.unary_unary(
            "/google.pubsub.v1.Publisher/CreateTopic",
            request_serializer=Topic.SerializeToString,
            response_deserializer=Topic.FromString,
        )(Topic(name=TOPIC), timeout=10)

    def publish(self, datas: list[bytes], header: str | None, **attributes: str) -> list[str]:
        messages = [PubsubMessage(data=data, attributes=attributes) for data in datas]
        metadata = [] if header is None else [(HEADER, header)]
        response = self._publish(
            PublishRequest(topic=TOPIC, messages=messages), timeout=10, metadata=metadata
        )
        return list(response.message_ids)


@pytest.fixture(params=[False, True], ids=["plain", "dedup-hedges"])
def dedup(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def server(dedup: bool) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, dedup_hedges=dedup) as local:
        yield local


def stored(server: LocalServer) -> list[bytes]:
    return [message.data for message in server.messages(TOPIC)]


@pytest.mark.parametrize("dedup", [True])
def test_dedup_stores_attempt_0_and_its_hedge_with_one_start_time_once(server: LocalServer) -> None:
    raw = Raw(server)
    start = int(time.time())
    first = raw.publish([b"a", b"b"], telemetry(0, start, 250_000_000), origin="go")
    hedge = raw.publish([b"a", b"b"], telemetry(1, start, 250_000_000), origin="go")
    assert hedge == first
    assert stored(server) == [b"a", b"b"]
    assert server.hedge_dedup is not None
    assert (server.hedge_dedup.counts.stored, server.hedge_dedup.counts.answered_from_window) == (1, 1)
    # A retry of the original (attempt 0 again) is the same batch too.
    assert raw.publish([b"a", b"b"], telemetry(0, start, 250_000_000), origin="go") == first
    assert stored(server) == [b"a", b"b"]


def test_without_dedup_every_attempt_is_stored_as_the_real_service_does(
    server: LocalServer, dedup: bool
) -> None:
    raw = Raw(server)
    start = int(time.time())
    first = raw.publish([b"a"], telemetry(0, start))
    hedge = raw.publish([b"a"], telemetry(1, start))
    assert (hedge == first) is dedup
    assert stored(server) == ([b"a"] if dedup else [b"a", b"a"])


@pytest.mark.parametrize("dedup", [True])
def test_dedup_stores_other_start_times_other_messages_and_no_start_time_each(server: LocalServer) -> None:
    raw = Raw(server)
    start = int(time.time())
    ids = [
        raw.publish([b"a"], telemetry(0, start)),
        raw.publish([b"a"], telemetry(1, start, 1)),  # another start time: another batch
        raw.publish([b"a"], telemetry(1, start + 1)),
        raw.publish([b"b"], telemetry(1, start)),  # same start time, other messages
        raw.publish([b"a"], telemetry(1, start), note="x"),  # other attributes
        raw.publish([b"a"], ATTEMPT_0),  # no start time: nothing tells a batch apart
        raw.publish([b"a"], ATTEMPT_1),
        raw.publish([b"a"], None),
    ]
    assert len({tuple(message_ids) for message_ids in ids}) == len(ids)
    assert stored(server) == [b"a", b"a", b"a", b"b", b"a", b"a", b"a", b"a"]


def test_stats_count_the_publishes_with_the_header_and_the_hedges(server: LocalServer) -> None:
    raw = Raw(server)
    start = int(time.time())
    raw.publish([b"1"], None)
    raw.publish([b"2"], ATTEMPT_0)
    raw.publish([b"3"], ATTEMPT_1)
    raw.publish([b"4"], telemetry(0, start))
    raw.publish([b"4"], telemetry(2, start))
    counts = server.hedge_telemetry.counts
    assert (counts.publishes, counts.with_telemetry, counts.hedges, counts.malformed) == (5, 4, 2, 0)


def test_a_malformed_header_is_ignored_and_logged_once(
    server: LocalServer, dedup: bool, caplog: pytest.LogCaptureFixture
) -> None:
    raw = Raw(server)
    with caplog.at_level(logging.WARNING, logger="hedgepub.server"):
        assert len(raw.publish([b"x"], "not base64!")) == 1
        assert len(raw.publish([b"x"], base64.b64encode(b"\xff\xff").decode())) == 1  # not a proto
        assert len(raw.publish([b"x"], "")) == 1  # no publish_operation
    warnings = [record.getMessage() for record in caplog.records if HEADER in record.getMessage()]
    assert len(warnings) == 1, warnings
    assert "malformed" in warnings[0]
    counts = server.hedge_telemetry.counts
    assert (counts.publishes, counts.with_telemetry, counts.malformed) == (3, 0, 3)
    assert stored(server) == [b"x", b"x", b"x"]  # never deduplicated: nothing tells them apart


def test_the_request_log_shows_the_attempt(server: LocalServer, caplog: pytest.LogCaptureFixture) -> None:
    raw = Raw(server)
    start = int(time.time())

    def logged() -> list[str]:
        return [
            record.getMessage()
            for record in caplog.records
            if record.name == "hedgepub.server.requests" and record.getMessage().startswith("Publish ")
        ]

    with caplog.at_level(logging.DEBUG, logger="hedgepub.server.requests"):
        raw.publish([b"1"], telemetry(0, start))
        raw.publish([b"2"], ATTEMPT_1)
        raw.publish([b"3"], None)
        raw.publish([b"4"], "not base64!")
        # The server logs when its handler has finished, which may come just after the client's answer.
        deadline = time.monotonic() + 5
        while len(logged()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = logged()
    assert len(lines) == 4, lines
    assert lines[0].startswith("Publish OK ") and lines[0].endswith(", attempt 0)")
    assert lines[1].endswith(", attempt 1)")
    assert "attempt" not in lines[2]
    assert lines[3].endswith(", attempt unknown (malformed client telemetry))")
