"""OpenTelemetry: spans like the official client's, a span per attempt, context for subscribers, metrics.

The SDK (a test dependency only) collects into memory through providers passed to the client, so no global
state is touched.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.open_telemetry.context_propagation import OpenTelemetryContextGetter
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from hedgepub import (
    AsyncPublisherClient,
    HedgingSettings,
    PublisherClient,
    RpcError,
    ShutdownTimeoutError,
    StatusCode,
)
from hedgepub.server import LocalServer
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import virtual_time

TOPIC = "projects/test-project/topics/orders"


@dataclass
class Telemetry:
    """Providers that keep what they receive in memory."""

    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def client_arguments(self) -> dict[str, Any]:
        return {
            "enable_open_telemetry": True,
            "tracer_provider": self.tracer_provider,
            "meter_provider": self.meter_provider,
        }

    def finished(self, suffix: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name.endswith(suffix)]

    def metric_points(self) -> dict[str, list[tuple[dict[str, Any], Any]]]:
        """Metric name -> [(attributes, value or count)] from one collection."""
        points: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        data = self.metrics.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        points.setdefault(metric.name, []).append(
                            (dict(point.attributes), point.count if value is None else value)
                        )
        return points


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(spans, reader, tracer_provider, meter_provider)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _span_id(span: ReadableSpan) -> str:
    return format(span.context.span_id, "016x")


@virtual_time
async def test_a_hedged_batch_is_traced_create_publish_and_each_attempt(telemetry: Telemetry) -> None:
    transport = ScriptedTransport()
    publisher = AsyncPublisherClient(
        transport=transport,
        hedging_settings=HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2),
        **telemetry.client_arguments(),
    )
    for _ in range(5):  # fill the bucket: one token
        await publisher.publish(TOPIC, b"warm-up")
    telemetry.spans.clear()
    transport.script.extend([transport.ok(delay=5.0), transport.ok(delay=0.02)])  # the hedge wins
    ids = await asyncio.gather(
        publisher.publish(TOPIC, b"first", origin="test"),
        publisher.publish(TOPIC, b"second", ordering_key=""),
    )
    await asyncio.sleep(0.01)  # the losing original's cancellation arrives
    await publisher.shutdown()

    creates = telemetry.finished(" create")
    assert [span.name for span in creates] == ["orders create", "orders create"]
    first = creates[0]
    assert first.kind is trace.SpanKind.PRODUCER
    assert {key: first.attributes[key] for key in first.attributes if key != "messaging.message.id"} == {
        "messaging.system": "gcp_pubsub",
        "messaging.destination.name": "orders",
        "code.function": "publish",
        "messaging.gcp_pubsub.message.ordering_key": "",
        "messaging.operation": "create",
        "gcp.project_id": "test-project",
        "messaging.message.body.size": 5,
    }
    assert [span.attributes["messaging.message.id"] for span in creates] == ids
    assert [event.name for event in first.events] == ["publish start", "publish end"]

    (batch,) = telemetry.finished(" publish")
    assert batch.kind is trace.SpanKind.CLIENT
    assert batch.attributes["messaging.batch.message_count"] == 2
    assert batch.attributes["messaging.operation"] == "publish"
    assert (batch.attributes["hedgepub.attempts"], batch.attributes["hedgepub.hedges_sent"]) == (2, 1)
    assert batch.attributes["hedgepub.winner_attempt"] == 1
    assert {link.context.span_id for link in batch.links} == {span.context.span_id for span in creates}
    assert all(link.context.span_id == batch.context.span_id for span in creates for link in span.links)

    attempts = sorted(
        telemetry.finished(" publish attempt"), key=lambda span: span.attributes["hedgepub.attempt.number"]
    )
    assert [span.parent.span_id for span in attempts if span.parent] == [batch.context.span_id] * 2
    assert [
        (
            span.attributes["hedgepub.attempt.number"],
            span.attributes["hedgepub.attempt.hedge"],
            span.attributes["hedgepub.attempt.status"],
            span.attributes["hedgepub.attempt.won"],
        )
        for span in attempts
    ] == [(0, False, "CANCELLED", False), (1, True, "OK", True)]
    assert [span.attributes["hedgepub.attempt.endpoint"] for span in attempts] == ["primary", "primary"]

    # Each message carries its create span's context where the official subscriber looks for it.
    sent = transport.calls[-2].request.messages
    assert [message.attributes["googclient_traceparent"].split("-")[2] for message in sent] == [
        _span_id(span) for span in creates
    ]
    assert sent[0].attributes["origin"] == "test"

    points = telemetry.metric_points()
    attempts_by_kind = {
        attributes["hedgepub.attempt.hedge"]: value
        for attributes, value in points["hedgepub.publish.attempts"]
    }
    assert attempts_by_kind == {False: 6, True: 1}
    assert [value for _, value in points["hedgepub.hedges.sent"]] == [1]
    assert [value for _, value in points["hedgepub.hedges.won"]] == [1]
    assert [value for _, value in points["hedgepub.messages.published"]] == [7]
    assert [value for _, value in points["hedgepub.publish.latency"]] == [6]  # one per batch


def test_the_official_subscriber_finds_the_trace_context(
    server: LocalServer, topic: str, subscription: str, telemetry: Telemetry
) -> None:
    tracer = telemetry.tracer_provider.get_tracer("test")
    with (
        PublisherClient(**telemetry.client_arguments()) as publisher,
        tracer.start_as_current_span("request"),
    ):
        publisher.publish(topic, b"traced", kind="order").result(timeout=30)
    (create,) = telemetry.finished(" create")
    (request,) = telemetry.finished("request")
    assert create.parent is not None and create.parent.span_id == request.context.span_id

    subscriber = pubsub_v1.SubscriberClient()
    try:
        response = subscriber.pull(subscription=subscription, max_messages=10, timeout=30)
    finally:
        subscriber.close()
    (received,) = response.received_messages
    # What the official subscriber does with enable_open_telemetry_tracing=True to find its parent span.
    context = TraceContextTextMapPropagator().extract(
        carrier=received.message, getter=OpenTelemetryContextGetter()
    )
    parent = trace.get_current_span(context).get_span_context()
    assert (parent.trace_id, parent.span_id) == (create.context.trace_id, create.context.span_id)
    assert received.message.attributes["kind"] == "order"


def test_a_failed_publish_marks_its_spans_and_counts_the_messages(
    server: LocalServer, topic: str, telemetry: Telemetry
) -> None:
    with PublisherClient(**telemetry.client_arguments()) as publisher:
        error = publisher.publish(topic + "-missing", b"nowhere").exception(timeout=30)
    assert isinstance(error, RpcError)
    (create,) = telemetry.finished(" create")
    (batch,) = telemetry.finished(" publish")
    (attempt,) = telemetry.finished(" publish attempt")
    assert create.status.status_code is trace.StatusCode.ERROR
    assert batch.status.status_code is trace.StatusCode.ERROR
    assert any(event.name == "exception" for event in batch.events)
    assert attempt.attributes["hedgepub.attempt.endpoint"] == server.address
    assert (attempt.attributes["hedgepub.attempt.status"], attempt.attributes["hedgepub.attempt.won"]) == (
        "NOT_FOUND",
        False,
    )
    points = telemetry.metric_points()
    assert [value for _, value in points["hedgepub.messages.failed"]] == [1]
    assert "hedgepub.messages.published" not in points


def test_gauges_report_tokens_and_the_hedge_delay_of_each_open_client(
    server: LocalServer, topic: str, telemetry: Telemetry
) -> None:
    hedging = HedgingSettings(hedge_delay=0.25, max_tokens=3, refill_ratio=0.2)
    with PublisherClient(hedging_settings=hedging, **telemetry.client_arguments()) as publisher:
        for _ in range(4):
            publisher.publish(topic, b"x").result(timeout=30)
        points = telemetry.metric_points()
        client_id = publisher._core._id_prefix
    assert points["hedgepub.hedge.delay"] == [({"hedgepub.client": client_id}, 0.25)]
    assert points["hedgepub.hedge.tokens"] == [({"hedgepub.client": client_id}, pytest.approx(0.8))]
    assert "hedgepub.hedge.tokens" not in telemetry.metric_points()  # a shut-down client is not reported


def test_off_unless_asked_and_on_through_the_official_options(
    server: LocalServer, telemetry: Telemetry
) -> None:
    with PublisherClient() as plain:
        # The core's own publish function: nothing traced on the hot path.
        assert vars(plain)["publish"] is plain._publish_function
        assert plain._core.telemetry is None
    options = pubsub_v1.types.PublisherOptions(enable_open_telemetry_tracing=True)
    with PublisherClient(
        publisher_options=options, client_options={"tracer_provider": telemetry.tracer_provider}
    ) as traced:
        assert "publish" in vars(traced) and traced._core.telemetry is not None
    with pytest.raises(ValueError, match="enable_open_telemetry=True"):
        PublisherClient(tracer_provider=telemetry.tracer_provider)


def test_without_the_extra_enabling_says_what_to_install(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if opentelemetry-api were not installed: importing it fails.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.delitem(sys.modules, "hedgepub._publisher.telemetry", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'hedgepub\[otel\]'"):
        PublisherClient(enable_open_telemetry=True)
    with PublisherClient() as plain:  # off: never imports it
        assert plain._core.telemetry is None


_SUBSCRIBER_SCRIPT = """
import json, sys, threading
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from google.cloud import pubsub_v1
from hedgepub import PublisherClient

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the official subscriber traces to the global provider only
topic, subscription = sys.argv[1], sys.argv[2]
with PublisherClient(enable_open_telemetry=True) as publisher:
    publisher.publish(topic, b"traced end to end").result(timeout=30)
received = threading.Event()
def callback(message):
    message.ack()
    received.set()
options = pubsub_v1.types.SubscriberOptions(enable_open_telemetry_tracing=True)
subscriber = pubsub_v1.SubscriberClient(subscriber_options=options)
future = subscriber.subscribe(subscription, callback)
assert received.wait(30), "no message received"
future.cancel()
future.result(timeout=30)
subscriber.close()
print(json.dumps([
    {"name": span.name, "trace": span.context.trace_id, "id": span.context.span_id,
     "parent": span.parent.span_id if span.parent else None}
    for span in exporter.get_finished_spans()
]))
"""


def test_the_official_subscriber_with_tracing_on_continues_the_trace(
    server: LocalServer, topic: str, subscription: str
) -> None:
    # A fresh interpreter: the official client traces to the global tracer provider, set once per process.
    done = subprocess.run(
        [sys.executable, "-c", _SUBSCRIBER_SCRIPT, topic, subscription],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PUBSUB_EMULATOR_HOST": server.address},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    (create,) = [span for span in spans if span["name"].endswith(" create")]
    subscribes = [span for span in spans if span["name"].endswith(" subscribe")]
    assert subscribes, [span["name"] for span in spans]
    # The official subscriber's span is a child of hedgepub's create span, in the same trace.
    assert all((span["trace"], span["parent"]) == (create["trace"], create["id"]) for span in subscribes)


@virtual_time
async def test_each_finished_batch_is_reported_once_to_stats_endpoints_and_telemetry(
    telemetry: Telemetry,
) -> None:
    # One event, one observer: a success, a refusal and a batch shutdown(timeout) cuts off are each counted
    # once by the stats, the endpoint and the telemetry, and no trace is left behind.
    transport = ScriptedTransport()
    transport.script.extend(
        [transport.ok(), transport.fail(StatusCode.PERMISSION_DENIED), transport.ok(delay=100.0)]
    )
    publisher = AsyncPublisherClient(transport=transport, **telemetry.client_arguments())
    await publisher.publish(TOPIC, b"stored")
    with pytest.raises(RpcError):
        await publisher.publish(TOPIC, b"refused")
    cut_off = asyncio.ensure_future(publisher.publish(TOPIC, b"cut off"))
    await asyncio.sleep(0.05)
    await publisher.shutdown(timeout=1.0)
    with pytest.raises(ShutdownTimeoutError):
        await cut_off
    stats = publisher.stats()
    assert (stats.batches_sent, stats.messages_published, stats.messages_failed) == (3, 1, 2)
    assert stats.endpoints["primary"].attempts_sent == 3
    assert len(telemetry.finished(" publish")) == 3  # one batch span each
    points = telemetry.metric_points()
    assert sum(value for _attributes, value in points["hedgepub.messages.published"]) == 1
    assert sum(value for _attributes, value in points["hedgepub.messages.failed"]) == 2
    assert publisher._core.telemetry._traces == {}  # type: ignore[union-attr]
