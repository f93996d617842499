"""What the proxy does with calls, against a real local server: Publish hedged (a slow original loses to
its hedge), keyed requests never hedged, the upstream's statuses and trailers passed back unchanged, the
caller's deadline honoured, a flood bounded, the caller's own token forwarded, every call logged."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterator
from typing import Any

import google.oauth2.credentials
import grpc
import pytest
from google.cloud import pubsub_v1
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub import HedgingSettings
from hedgepub.admin import AdminClient
from hedgepub.proxy import Proxy
from hedgepub.server import FaultRule, IamConfig, LocalServer

from .conftest import AttemptRecorder, unique

PUBLISH = "/google.pubsub.v1.Publisher/Publish"
GET_TOPIC = "/google.pubsub.v1.Publisher/GetTopic"
ACKNOWLEDGE = "/google.pubsub.v1.Subscriber/Acknowledge"
DETAILS_KEY = "grpc-status-details-bin"


def publish_request(topic: str, *payloads: bytes, ordering_key: str = "") -> bytes:
    request = pubsub_types.PublishRequest.pb()(topic=topic)
    for payload in payloads:
        request.messages.add(data=payload, ordering_key=ordering_key)
    return bytes(request.SerializeToString())


@pytest.fixture
def raw(proxy: Proxy) -> Iterator[grpc.Channel]:
    """A plain gRPC channel to the proxy: bytes in, bytes out."""
    with grpc.insecure_channel(proxy.address) as channel:
        yield channel


def call(channel: grpc.Channel, method: str, request: bytes, **kwargs: Any) -> Any:
    return channel.unary_unary(method)(request, **kwargs)


def fill_bucket(channel: grpc.Channel, topic: str, successes: int = 10) -> None:
    """Quick publishes through the proxy, whose successes fill the topic's token bucket (0.2 each)."""
    for number in range(successes):
        call(channel, PUBLISH, publish_request(topic, b"warm-up %d" % number), timeout=10)


def create_topic(upstream: LocalServer) -> str:
    topic = unique("topics")
    with AdminClient(upstream.address) as admin:
        admin.create_topic(topic)
    return topic


# ---- hedging --------------------------------------------------------------------------------------------


def test_a_slow_publish_of_the_official_client_is_won_by_the_proxys_hedge(
    proxy: Proxy, upstream: LocalServer, recorder: AttemptRecorder, raw: grpc.Channel
) -> None:
    topic = create_topic(upstream)
    fill_bucket(raw, topic)
    publisher = pubsub_v1.PublisherClient()
    latencies = []
    for number in range(20):
        data = b"slow %d" % number if number % 5 == 0 else b"quick %d" % number
        started = time.perf_counter()
        publisher.publish(topic, data).result(timeout=20)
        latencies.append(time.perf_counter() - started)
    # Each slow request's original is held 30 s by the server; its hedge, sent 100 ms later, answered.
    assert max(latencies) < recorder.held_seconds
    stats = proxy.stats()
    assert stats.hedges_won >= 4 and stats.messages_published == 30
    hedges = [attempt for attempt, _ in recorder.attempts if attempt > 0]
    assert len(hedges) >= 4


def test_a_keyed_request_is_never_hedged(
    proxy: Proxy, upstream: LocalServer, recorder: AttemptRecorder, raw: grpc.Channel
) -> None:
    topic = create_topic(upstream)
    fill_bucket(raw, topic)
    recorder.held_seconds = 0.5  # the keyed original is held, and nothing else is sent meanwhile
    response = call(raw, PUBLISH, publish_request(topic, b"slow keyed", ordering_key="k"), timeout=10)
    assert len(pubsub_types.PublishResponse.pb().FromString(response).message_ids) == 1
    assert [attempt for attempt, keys in recorder.attempts if "k" in keys] == [0]
    assert proxy.stats().unhedged_keyed_batches == 1


# ---- statuses ---------------------------------------------------------------------------------------------


def test_the_upstreams_status_and_details_come_back_unchanged(
    proxy: Proxy, upstream: LocalServer, raw: grpc.Channel
) -> None:
    topic = create_topic(upstream)
    subscription = unique("subscriptions")
    subscriber = pubsub_v1.SubscriberClient()
    subscriber.create_subscription(
        request={"name": subscription, "topic": topic, "enable_exactly_once_delivery": True}
    )
    subscriber.close()
    request = pubsub_types.AcknowledgeRequest.pb()(subscription=subscription, ack_ids=["bogus"])
    answers = []
    with grpc.insecure_channel(upstream.address) as direct:
        for channel in (direct, raw):
            with pytest.raises(grpc.RpcError) as raised:
                call(channel, ACKNOWLEDGE, request.SerializeToString(), timeout=10)
            error = raised.value
            trailers = dict(error.trailing_metadata())
            answers.append((error.code(), error.details(), trailers.get(DETAILS_KEY)))
    assert answers[0][0] is grpc.StatusCode.INVALID_ARGUMENT and answers[0][2]  # an ErrorInfo in the trailer
    assert answers[1] == answers[0]


def test_errors_reach_the_official_client_with_their_codes(proxy: Proxy, upstream: LocalServer) -> None:
    from google.api_core import exceptions

    publisher = pubsub_v1.PublisherClient()
    missing = unique("topics")
    with pytest.raises(exceptions.NotFound):
        publisher.get_topic(topic=missing)
    with pytest.raises(exceptions.NotFound):  # Publish, through the core's forwarding
        publisher.publish(missing, b"nowhere").result(timeout=20)
    with pytest.raises(exceptions.InvalidArgument):
        publisher.create_topic(name="projects/p/topics/x")  # an ID of one character


def test_bad_input_gets_the_services_own_answer(
    proxy: Proxy, upstream: LocalServer, raw: grpc.Channel
) -> None:
    topic = create_topic(upstream)
    answers: dict[str, list[Any]] = {}
    with grpc.insecure_channel(upstream.address) as direct:
        for name, method, request in [
            ("garbage publish", PUBLISH, b"\xff\xff\xff"),
            ("no messages", PUBLISH, publish_request(topic)),
            ("no topic", PUBLISH, publish_request("", b"x")),
            ("garbage get", GET_TOPIC, b"\xff\xff\xff"),
        ]:
            for channel in (direct, raw):
                with pytest.raises(grpc.RpcError) as raised:
                    call(channel, method, request, timeout=10)
                answers.setdefault(name, []).append((raised.value.code(), raised.value.details()))
    # Through the proxy, each is answered as the server itself answers it.
    assert all(through == straight for straight, through in answers.values()), answers
    assert {answer[0][0] for answer in answers.values()} == {grpc.StatusCode.INVALID_ARGUMENT}
    # A method outside google.pubsub.v1 (and IAMPolicy) is not forwarded: UNIMPLEMENTED, as the service.
    with pytest.raises(grpc.RpcError) as raised:
        call(raw, "/google.pubsub.v1.Publisher/NoSuchMethod", b"", timeout=10)
    assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_a_dead_upstream_is_unavailable() -> None:
    with LocalServer(in_memory=True) as gone:
        address = gone.address
    with (
        Proxy(address, hedging_settings=HedgingSettings()) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
    ):
        for method, request in [(GET_TOPIC, b""), (PUBLISH, publish_request("projects/p/topics/dead", b"x"))]:
            with pytest.raises(grpc.RpcError) as raised:
                call(channel, method, request, timeout=3)
            assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ---- deadlines and load -----------------------------------------------------------------------------------


def test_the_callers_deadline_is_honoured(
    proxy: Proxy, upstream: LocalServer, recorder: AttemptRecorder, raw: grpc.Channel
) -> None:
    topic = create_topic(upstream)
    upstream.faults.set("Publish", FaultRule(latency="100%:30s"))
    with pytest.raises(grpc.RpcError) as raised:
        call(raw, PUBLISH, publish_request(topic, b"late"), timeout=0.5)
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The proxy's own attempts end with the caller's deadline: the publish is counted as failed, and
    # nothing is left in flight. (The batch fails at the deadline; its cancelled attempt is counted out a
    # moment later, when its task has run its cancellation: wait for both, far short of the 30 s stall.)
    waited = time.monotonic()
    while time.monotonic() - waited < 20:
        stats = proxy.stats()
        if stats.messages_failed >= 1 and stats.attempts_in_flight == 0:
            break
        time.sleep(0.01)
    stats = proxy.stats()
    assert stats.messages_failed == 1 and stats.attempts_in_flight == 0
    assert proxy.in_flight.bytes == 0
    assert upstream.messages(topic) == []


def test_a_flood_is_bounded_and_answered_resource_exhausted(upstream: LocalServer) -> None:
    topic = create_topic(upstream)
    upstream.faults.set("Publish", FaultRule(latency="100%:300ms"))
    payload = b"x" * 1000
    request = publish_request(topic, payload)
    with (
        Proxy(upstream.address, max_in_flight_bytes=10 * len(request)) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
        concurrent.futures.ThreadPoolExecutor(50) as pool,
    ):
        futures = [
            pool.submit(channel.unary_unary(PUBLISH).with_call, request, timeout=30) for _ in range(50)
        ]
        codes = []
        for future in futures:
            try:
                future.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        ok = codes.count(grpc.StatusCode.OK)
        assert ok >= 10 and proxy.in_flight.refused == 50 - ok
        assert len(upstream.messages(topic)) == ok and proxy.in_flight.bytes == 0
        upstream.faults.clear()
        call(channel, PUBLISH, request, timeout=10)  # and it serves again once the flood is over
    assert len(upstream.messages(topic)) == ok + 1


# ---- credentials and the request log -------------------------------------------------------------------


def test_the_callers_token_is_forwarded_and_the_proxys_used_for_callers_without_one() -> None:
    tokens = {"t-admin": "user:admin@example.com", "t-proxy": "user:proxy@example.com"}
    policy = {
        "bindings": [
            {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
            {"role": "roles/pubsub.viewer", "members": ["user:proxy@example.com"]},
        ]
    }
    topic = f"projects/{unique('topics').split('/')[1]}/topics/guarded"
    with (
        LocalServer(in_memory=True, iam=IamConfig(tokens, policy)) as upstream,
        Proxy(upstream.address, credentials=google.oauth2.credentials.Credentials("t-proxy")) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
    ):
        admin = [("authorization", "Bearer t-admin")]
        topic_request = pubsub_types.Topic.pb()(name=topic).SerializeToString()
        call(channel, "/google.pubsub.v1.Publisher/CreateTopic", topic_request, metadata=admin, timeout=10)
        get = pubsub_types.GetTopicRequest.pb()(topic=topic).SerializeToString()
        call(channel, GET_TOPIC, get, timeout=10)  # the proxy's token: a viewer may get it
        with pytest.raises(grpc.RpcError) as raised:  # but not publish
            call(channel, PUBLISH, publish_request(topic, b"as the proxy"), timeout=10)
        assert raised.value.code() is grpc.StatusCode.PERMISSION_DENIED
        call(channel, PUBLISH, publish_request(topic, b"as the admin"), metadata=admin, timeout=10)
        assert [m.data for m in upstream.messages(topic)] == [b"as the admin"]


def test_every_call_is_logged(proxy: Proxy, upstream: LocalServer, raw: grpc.Channel, caplog: Any) -> None:
    topic = create_topic(upstream)
    with caplog.at_level(logging.DEBUG, logger="hedgepub.proxy.requests"):
        call(raw, PUBLISH, publish_request(topic, b"logged"), timeout=10)
        with pytest.raises(grpc.RpcError):
            call(
                raw, GET_TOPIC, pubsub_types.GetTopicRequest.pb()(topic=unique("topics")).SerializeToString()
            )
    lines = [record.getMessage() for record in caplog.records if record.name == "hedgepub.proxy.requests"]
    assert any(line.startswith("Publish OK") and "1 attempt" in line for line in lines), lines
    assert any(line.startswith("GetTopic NOT_FOUND") for line in lines), lines


def test_hedges_sent_and_won_are_in_the_opentelemetry_metrics_per_topic(
    upstream: LocalServer, recorder: AttemptRecorder
) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    topic = create_topic(upstream)
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=10, refill_ratio=0.2)
    with (
        Proxy(
            upstream.address,
            hedging_settings=hedging,
            enable_open_telemetry=True,
            meter_provider=MeterProvider(metric_readers=[reader]),
        ) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
    ):
        fill_bucket(channel, topic)
        call(channel, PUBLISH, publish_request(topic, b"slow, held"), timeout=20)
        data = reader.get_metrics_data()
    points = {
        (metric.name, point.attributes.get("messaging.destination.name")): point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
        if metric.name in ("hedgepub.hedges.sent", "hedgepub.hedges.won", "hedgepub.messages.published")
    }
    short = topic.rsplit("/", 1)[1]
    assert points[("hedgepub.hedges.won", short)] == 1
    assert points[("hedgepub.hedges.sent", short)] >= 1
    assert points[("hedgepub.messages.published", short)] == 11


def test_every_unary_rpc_of_the_table_is_forwarded(upstream: LocalServer, raw: grpc.Channel) -> None:
    from hedgepub._rpcs import RPCS

    def code(channel: grpc.Channel, path: str) -> grpc.StatusCode:
        try:
            call(channel, path, b"", timeout=10)  # an empty request: each method's own answer to it
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    unary = [rpc.path for rpc in RPCS.values() if not rpc.streaming]
    with grpc.insecure_channel(upstream.address) as direct:
        answers = {path: (code(direct, path), code(raw, path)) for path in unary}
    assert all(straight == through for straight, through in answers.values()), answers
    assert grpc.StatusCode.UNIMPLEMENTED not in {straight for straight, _ in answers.values()}
