"""OpenTelemetry traces and metrics of a publisher (``enable_open_telemetry=True``; extra ``hedgepub[otel]``).

Built on ``opentelemetry-api`` only: spans and metrics go to whatever tracer and meter providers the
application installed (the SDK, an exporter), and cost next to nothing when it installed none. Nothing
here is imported, and the publish path is not touched, unless a client asks for it: an enabled client's
``publish`` is replaced, on that instance, by :meth:`PublisherTelemetry.traced_sync_publish` or
:meth:`~PublisherTelemetry.traced_async_publish`, and its batches call
:meth:`~PublisherTelemetry.start_batch`.
The hedging engine stays pure: attempts are traced by wrapping the attempt function the driver runs.

The spans follow the official client's (google-cloud-pubsub 2.x, ``enable_open_telemetry_tracing=True``)
so that the same dashboards and the official subscriber's traces line up:

* ``"<topic> create"`` (PRODUCER), one per message, from ``publish`` until its batch is answered, with
  ``messaging.system=gcp_pubsub``, ``messaging.destination.name``, ``messaging.operation=create``,
  ``gcp.project_id``, ``code.function``, ``messaging.gcp_pubsub.message.ordering_key``,
  ``messaging.message.body.size`` (the data's length in bytes), events ``publish start`` / ``publish end``
  and, once published, ``messaging.message.id``. Its W3C trace context is put in the message's
  ``googclient_traceparent`` attribute (``googclient_tracestate`` when there is one), where the official
  subscriber looks for it.
* ``"<topic> publish"`` (CLIENT), one per batch, linked to the create spans of its messages (and they to
  it), with ``messaging.batch.message_count``, ``messaging.operation=publish`` and hedgepub's
  ``hedgepub.batch_id``, ``hedgepub.attempts``, ``hedgepub.hedges_sent``, ``hedgepub.winner_attempt``.
* ``"<topic> publish attempt"`` (CLIENT), a child of the batch span for every RPC sent (the original, its
  retries, each hedge), with ``rpc.system=grpc``, ``rpc.service``, ``rpc.method``,
  ``hedgepub.attempt.number`` (0 for the original and its retries, k for hedge k),
  ``hedgepub.attempt.hedge``, ``hedgepub.attempt.endpoint`` (where it went: ``host:port``, see
  ``hedge_endpoints``), ``hedgepub.attempt.status`` (``OK``, a status code name, or ``CANCELLED`` for a loser
  cancelled once another attempt won) and ``hedgepub.attempt.won``.

Metrics (meter ``hedgepub``), each with ``messaging.destination.name`` where it is about a topic:

=================================  =========================  =============================================
name                               kind (unit)                meaning
=================================  =========================  =============================================
``hedgepub.publish.attempts``      counter                    RPCs sent; ``hedgepub.attempt.hedge`` true/false
``hedgepub.hedges.sent``           counter                    hedges sent
``hedgepub.hedges.won``            counter                    batches a hedge won
``hedgepub.hedges.skipped``        counter                    hedge points with no token in the bucket
``hedgepub.publish.latency``       histogram (s)              batch latency, first attempt to answer;
                                                              ``hedgepub.outcome`` ok/error
``hedgepub.messages.published``    counter                    messages published
``hedgepub.messages.failed``       counter                    messages whose publish failed
``hedgepub.hedge.tokens``          observable gauge           tokens in all topics' buckets, per client
``hedgepub.hedge.delay``           observable gauge (s)       the hedge delay now (fixed or adaptive)
=================================  =========================  =============================================

The gauges carry ``hedgepub.client`` (a per-client id) so that several clients can be told apart.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace

from hedgepub._exceptions import PublishError, RpcError
from hedgepub._version import __version__

if TYPE_CHECKING:
    from hedgepub._hedging.engine import BatchOutcome
    from hedgepub._publisher.batch import Batch

#: The name of hedgepub's tracer and meter.
INSTRUMENTATION_NAME = "hedgepub"
#: The message attribute prefix under which the official clients carry trace context.
CONTEXT_ATTRIBUTE_PREFIX = "googclient_"
TRACEPARENT_ATTRIBUTE = CONTEXT_ATTRIBUTE_PREFIX + "traceparent"
_MESSAGING_SYSTEM = "gcp_pubsub"


def _topic_parts(topic: str) -> tuple[str, str]:
    """(project, short topic name) of ``projects/{project}/topics/{topic}``; the whole name if malformed."""
    parts = topic.split("/")
    if len(parts) == 4:
        return parts[1], parts[3]
    return "", topic


class _AttemptRecord:
    """One attempt's span, kept open until the batch ends so that ``won`` can be set on it."""

    __slots__ = ("closed", "end_ns", "number", "span", "status")

    def __init__(self, span: trace.Span, number: int) -> None:
        self.span = span
        self.number = number
        self.status: str | None = None
        self.end_ns: int | None = None
        self.closed = False


class BatchTrace:
    """The publish span of one batch and the spans of its attempts."""

    def __init__(self, telemetry: PublisherTelemetry, batch: Batch) -> None:
        self._telemetry = telemetry
        project, short = _topic_parts(batch.topic)
        self._short = short
        self._create_spans = telemetry.create_spans_of(batch.request.messages)
        links = [
            trace.Link(span.get_span_context())
            for span in self._create_spans
            if span is not None and span.get_span_context().trace_flags.sampled
        ]
        self.span = telemetry.tracer.start_span(
            f"{short} publish",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "messaging.system": _MESSAGING_SYSTEM,
                "messaging.destination.name": short,
                "gcp.project_id": project,
                "messaging.batch.message_count": len(batch.request.messages),
                "messaging.operation": "publish",
                "code.function": "publish_batch",
                "hedgepub.batch_id": batch.batch_id,
            },
            links=links,
        )
        context = self.span.get_span_context()
        for span in self._create_spans:
            if span is not None and span.get_span_context().trace_flags.sampled and hasattr(span, "add_link"):
                span.add_link(context)
        self._parent = trace.set_span_in_context(self.span)
        self._attempts: list[_AttemptRecord] = []

    def wrap(
        self,
        attempt: Callable[[int, float], Awaitable[Sequence[str]]],
        endpoint_of: Callable[[int], str] | None = None,
    ) -> Callable[[int, float], Awaitable[Sequence[str]]]:
        """``attempt`` with a span around each call; ``endpoint_of(attempt_number)`` names where it goes."""
        tracer = self._telemetry.tracer
        name = f"{self._short} publish attempt"

        async def traced(attempt_number: int, timeout: float) -> Sequence[str]:
            span = tracer.start_span(
                name,
                context=self._parent,
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": "google.pubsub.v1.Publisher",
                    "rpc.method": "Publish",
                    "hedgepub.attempt.number": attempt_number,
                    "hedgepub.attempt.hedge": attempt_number > 0,
                    "hedgepub.attempt.timeout_s": timeout,
                    "hedgepub.attempt.endpoint": endpoint_of(attempt_number) if endpoint_of else "",
                },
            )
            record = _AttemptRecord(span, attempt_number)
            self._attempts.append(record)
            try:
                ids = await attempt(attempt_number, timeout)
            except BaseException as error:
                if not record.closed:
                    record.end_ns = time.time_ns()
                    if isinstance(error, RpcError):
                        record.status = error.code.name
                    elif not isinstance(error, Exception):  # cancelled: the batch decides what it means
                        record.status = "CANCELLED"
                    else:
                        record.status = type(error).__name__
                    if isinstance(error, Exception):
                        span.record_exception(error)
                raise
            if not record.closed:
                record.end_ns = time.time_ns()
                record.status = "OK"
            return ids

        return traced

    def end(self, outcome: BatchOutcome | None, error: BaseException | None = None) -> None:
        """The batch is over: end the attempt spans (marking the winner) and the batch span; count it.

        On success the create spans of its messages end too, with their message IDs.
        """
        telemetry = self._telemetry
        winner = outcome.winner_attempt if outcome is not None and outcome.ok else None
        won_marked = False
        now = time.time_ns()
        for record in self._attempts:
            record.closed = True
            status = record.status or "CANCELLED"  # still running: a loser the engine cancelled
            won = not won_marked and status == "OK" and record.number == winner
            won_marked = won_marked or won
            span = record.span
            span.set_attribute("hedgepub.attempt.status", status)
            span.set_attribute("hedgepub.attempt.won", won)
            if status not in ("OK", "CANCELLED"):
                span.set_status(trace.Status(trace.StatusCode.ERROR, status))
            span.end(end_time=record.end_ns or now)
        failure = error if error is not None else (outcome.error if outcome is not None else None)
        span = self.span
        if outcome is not None:
            span.set_attribute("hedgepub.attempts", outcome.attempts_sent)
            span.set_attribute("hedgepub.hedges_sent", outcome.hedges_sent)
            if winner is not None:
                span.set_attribute("hedgepub.winner_attempt", winner)
        if failure is not None:
            span.record_exception(failure)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
        span.end()
        message_ids = outcome.message_ids if outcome is not None and outcome.ok else None
        telemetry.end_create_spans(self._create_spans, message_ids, failure)
        telemetry.record_batch(self._short, len(self._create_spans), outcome, failure)


class PublisherTelemetry:
    """The tracer, the instruments and the open create spans of one publisher."""

    def __init__(
        self,
        client_id: str,
        gauge_values: weakref.WeakMethod[Callable[[], tuple[float, float]]] | None,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        self.tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider=meter_provider)
        self.client_id = client_id
        self._attempts = meter.create_counter(
            "hedgepub.publish.attempts", unit="{attempt}", description="RPCs sent"
        )
        self._hedges_sent = meter.create_counter(
            "hedgepub.hedges.sent", unit="{hedge}", description="Hedges sent"
        )
        self._hedges_won = meter.create_counter(
            "hedgepub.hedges.won", unit="{batch}", description="Batches a hedge won"
        )
        self._hedges_skipped = meter.create_counter(
            "hedgepub.hedges.skipped", unit="{hedge}", description="Hedge points with no token in the bucket"
        )
        self._latency = meter.create_histogram(
            "hedgepub.publish.latency", unit="s", description="Batch publish latency, first attempt to answer"
        )
        self._published = meter.create_counter(
            "hedgepub.messages.published", unit="{message}", description="Messages published"
        )
        self._failed = meter.create_counter(
            "hedgepub.messages.failed", unit="{message}", description="Messages whose publish failed"
        )
        if gauge_values is not None:
            _register_gauges(meter, self, gauge_values)
        self._topics: dict[str, tuple[str, str]] = {}
        # Create spans (and their short topic names) by span id (16 hex digits, as in the traceparent),
        # from publish until they end.
        self._open: dict[str, tuple[trace.Span, str]] = {}
        self._lock = threading.Lock()
        #: The traces of the batches being sent, from :meth:`start_batch` to :meth:`batch_finished` (both
        #: on the publisher's loop).
        self._traces: dict[Batch, BatchTrace] = {}

    # ---- one message ---------------------------------------------------------------------------------

    def start_create(
        self, topic: str, data: Any, ordering_key: str, attributes: dict[str, Any]
    ) -> str | None:
        """Start a message's create span and put its trace context in ``attributes``.

        Returns the span's id (16 hex digits) while it waits for its batch, or ``None`` when there is
        nothing to end: no SDK installed (an invalid context, nothing is added to the message), or a span
        the sampler dropped (its context still travels, so that the subscriber samples alike).
        """
        names = self._topics.get(topic)
        if names is None:
            names = self._topics[topic] = _topic_parts(topic)
        project, short = names
        span = self.tracer.start_span(
            short + " create",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": _MESSAGING_SYSTEM,
                "messaging.destination.name": short,
                "code.function": "publish",
                "messaging.gcp_pubsub.message.ordering_key": ordering_key,
                "messaging.operation": "create",
                "gcp.project_id": project,
                "messaging.message.body.size": len(data) if isinstance(data, (bytes, bytearray)) else 0,
            },
        )
        context = span.get_span_context()
        if not context.is_valid:
            return None
        # The W3C traceparent, as TraceContextTextMapPropagator writes it, without its per-call overhead.
        span_id = format(context.span_id, "016x")
        attributes[TRACEPARENT_ATTRIBUTE] = f"00-{context.trace_id:032x}-{span_id}-{context.trace_flags:02x}"
        if context.trace_state:
            attributes[CONTEXT_ATTRIBUTE_PREFIX + "tracestate"] = context.trace_state.to_header()
        if not span.is_recording():
            return None
        span.add_event("publish start")
        with self._lock:
            self._open[span_id] = (span, short)
        return span_id

    def finish_create(self, span_id: str, error: BaseException | None) -> None:
        """End a create span that no batch ended (its publish raised, or its future failed without a
        batch: a paused ordering key, a shutdown timeout); count the message as failed then."""
        with self._lock:
            entry = self._open.pop(span_id, None)
        if entry is None:
            return
        span, short = entry
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            self._failed.add(1, {"messaging.destination.name": short})
        span.end()

    def create_spans_of(self, messages: Iterable[Any]) -> list[trace.Span | None]:
        """The open create span of each message of a batch (``None`` for a message published untraced)."""
        spans: list[trace.Span | None] = []
        with self._lock:
            for message in messages:
                parent = message.attributes.get(TRACEPARENT_ATTRIBUTE, "")
                entry = self._open.get(parent[36:52]) if len(parent) >= 52 else None
                spans.append(entry[0] if entry is not None else None)
        return spans

    def end_create_spans(
        self,
        spans: Sequence[trace.Span | None],
        message_ids: Sequence[str] | None,
        error: BaseException | None,
    ) -> None:
        """End the create spans of a batch's messages, with their IDs or the batch's error."""
        ended: list[tuple[int, trace.Span]] = []
        with self._lock:
            for index, span in enumerate(spans):
                if span is not None and self._open.pop(
                    format(span.get_span_context().span_id, "016x"), False
                ):
                    ended.append((index, span))
        for index, span in ended:
            span.add_event("publish end")
            if message_ids is not None:
                span.set_attribute("messaging.message.id", message_ids[index])
            if error is not None:
                span.record_exception(error)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            span.end()

    def close(self) -> None:
        """The client has shut down: stop reporting its gauges."""
        with _GAUGE_LOCK:
            _GAUGE_SOURCES.pop(self, None)

    # ---- publish wrappers ----------------------------------------------------------------------------

    def traced_sync_publish(self, publish: Callable[..., Any]) -> Callable[..., Any]:
        """``PublisherClient.publish`` (bound) with a create span per message."""

        def traced(topic: str, data: bytes, ordering_key: str = "", **attributes: Any) -> Any:
            span_id = self.start_create(topic, data, ordering_key, attributes)
            if span_id is None:
                return publish(topic, data, ordering_key, **attributes)
            try:
                future = publish(topic, data, ordering_key, **attributes)
            except BaseException as error:
                self.finish_create(span_id, error)
                raise
            # Its batch ends the span; this ends it when no batch will (a paused key, a shutdown timeout).
            future.add_done_callback(lambda done: self.finish_create(span_id, _error_of(done)))
            return future

        traced.__doc__ = publish.__doc__
        return traced

    def traced_async_publish(self, publish: Callable[..., Awaitable[str]]) -> Callable[..., Awaitable[str]]:
        """``AsyncPublisherClient.publish`` (bound) with a create span per message."""

        async def traced(topic: str, data: bytes, ordering_key: str = "", **attributes: Any) -> str:
            span_id = self.start_create(topic, data, ordering_key, attributes)
            if span_id is None:
                return await publish(topic, data, ordering_key, **attributes)
            try:
                message_id = await publish(topic, data, ordering_key, **attributes)
            except BaseException as error:
                self.finish_create(span_id, error)
                raise
            self.finish_create(span_id, None)
            return message_id

        traced.__doc__ = publish.__doc__
        return traced

    # ---- batches -------------------------------------------------------------------------------------

    def start_batch(self, batch: Batch) -> BatchTrace:
        """Start the publish span of ``batch`` (call on the loop, when the batch starts sending); it ends
        when the batch finishes (:meth:`batch_finished`)."""
        traced = self._traces[batch] = BatchTrace(self, batch)
        return traced

    def batch_finished(self, batch: Batch, outcome: BatchOutcome | None, error: BaseException | None) -> None:
        """End the spans of a finished batch and count it (a
        :class:`~hedgepub._publisher.observer.BatchObserver`); nothing for a batch never started."""
        traced = self._traces.pop(batch, None)
        if traced is not None:
            traced.end(outcome, error)

    def record_batch(
        self, short_topic: str, message_count: int, outcome: BatchOutcome | None, error: BaseException | None
    ) -> None:
        """Count one finished batch in the metrics."""
        attributes = {"messaging.destination.name": short_topic}
        if outcome is not None:
            hedges = outcome.hedges_sent
            self._attempts.add(
                outcome.attempts_sent - hedges, {**attributes, "hedgepub.attempt.hedge": False}
            )
            if hedges:
                self._attempts.add(hedges, {**attributes, "hedgepub.attempt.hedge": True})
                self._hedges_sent.add(hedges, attributes)
            if outcome.hedge_won:
                self._hedges_won.add(1, attributes)
            if outcome.hedges_skipped:
                self._hedges_skipped.add(outcome.hedges_skipped, attributes)
            ok = outcome.ok and error is None
            self._latency.record(outcome.latency, {**attributes, "hedgepub.outcome": "ok" if ok else "error"})
        else:
            ok = False
        (self._published if ok else self._failed).add(message_count, attributes)


def _error_of(future: Any) -> BaseException | None:
    if future.cancelled():
        return PublishError("the publish future was cancelled")
    return future.exception()


# The gauges are created once per meter and read every live client's state, since an instrument name can
# be registered only once per meter.
# Each source is a weak reference to its client's (tokens, delay) method, so that registering a client
# does not keep it alive.
_GAUGE_SOURCES: weakref.WeakKeyDictionary[
    PublisherTelemetry, weakref.WeakMethod[Callable[[], tuple[float, float]]]
] = weakref.WeakKeyDictionary()
_GAUGE_METERS: weakref.WeakSet[Any] = weakref.WeakSet()
_GAUGE_LOCK = threading.Lock()


def _observe(index: int) -> Callable[[Any], Iterable[metrics.Observation]]:
    def callback(_options: Any) -> Iterable[metrics.Observation]:
        with _GAUGE_LOCK:
            sources = list(_GAUGE_SOURCES.items())
        observations = []
        for telemetry, source in sources:
            values = source()
            read = values() if values is not None else None
            if read is not None:
                observations.append(
                    metrics.Observation(read[index], {"hedgepub.client": telemetry.client_id})
                )
        return observations

    return callback


def _register_gauges(
    meter: Any, telemetry: PublisherTelemetry, source: weakref.WeakMethod[Callable[[], tuple[float, float]]]
) -> None:
    with _GAUGE_LOCK:
        _GAUGE_SOURCES[telemetry] = source
        try:
            known = meter in _GAUGE_METERS
        except TypeError:  # a meter that cannot be weakly referenced: register on every client
            known = False
        if known:
            return
        meter.create_observable_gauge(
            "hedgepub.hedge.tokens",
            callbacks=[_observe(0)],
            unit="{token}",
            description="Tokens in the hedge bucket",
        )
        meter.create_observable_gauge(
            "hedgepub.hedge.delay", callbacks=[_observe(1)], unit="s", description="The hedge delay now"
        )
        with contextlib.suppress(TypeError):
            _GAUGE_METERS.add(meter)
