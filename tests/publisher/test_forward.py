"""Forwarding a request that exists already (``_PublisherCore.forward``, what ``hedgepub proxy`` does with a
client's Publish): the bytes go as they are through the publisher's hedging and retry path, on virtual
time against a scripted transport; the caller's own token goes through to a real server with IAM."""

from __future__ import annotations

import asyncio
from typing import Any

import google.oauth2.credentials
import pytest

from hedgepub import AsyncPublisherClient, HedgingSettings, PublishTimeoutError, RetrySettings, StatusCode
from hedgepub._exceptions import RpcError
from hedgepub._publisher.core import _PublisherCore
from hedgepub._transport.grpc import PublishRequestPb
from hedgepub._wire import BATCH_ID_KEY, CLIENT_TELEMETRY_KEY, REQUEST_PARAMS_KEY, decode_client_telemetry
from hedgepub.server import IamConfig, LocalServer
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import virtual_time

TOPIC = "projects/test-project/topics/forwarded"


def wire(*payloads: bytes, ordering_key: str = "", topic: str = TOPIC) -> bytes:
    """A client's serialized PublishRequest."""
    request = PublishRequestPb(topic=topic)
    for payload in payloads:
        request.messages.add(data=payload, ordering_key=ordering_key)
    return bytes(request.SerializeToString())


def core_of(publisher: AsyncPublisherClient) -> _PublisherCore:
    return publisher._core


def now() -> float:
    return asyncio.get_running_loop().time()


async def hedging_core(transport: ScriptedTransport) -> tuple[AsyncPublisherClient, _PublisherCore]:
    """A hedging publisher (delay 0.1 s) whose topic's bucket holds its one token (five quick forwards)."""
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=1, refill_ratio=0.2)
    publisher = AsyncPublisherClient(transport=transport, hedging_settings=hedging)
    core = core_of(publisher)
    for _ in range(5):
        assert (await core.forward(TOPIC, "", wire(b"warm-up"), 1)).ok
    assert publisher.stats().tokens_by_topic[TOPIC] == 1
    return publisher, core


@virtual_time
async def test_the_request_goes_as_it_is_with_the_publishers_metadata_and_the_callers() -> None:
    transport = ScriptedTransport()
    publisher = AsyncPublisherClient(transport=transport)
    request = wire(b"a", b"b", b"c")
    outcome = await core_of(publisher).forward(TOPIC, "", request, 3, (("x-caller", "yes"),))
    assert outcome.ok and outcome.message_ids == ("0", "1", "2")
    [call] = transport.calls
    assert call.request.SerializeToString() == request
    assert call.metadata[REQUEST_PARAMS_KEY] == "topic=" + TOPIC
    assert decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0] == 0
    assert call.metadata[BATCH_ID_KEY] and call.metadata["x-caller"] == "yes"
    stats = publisher.stats()
    assert (stats.messages_published, stats.batches_sent, stats.attempts_sent) == (3, 1, 1)
    await publisher.shutdown()


@virtual_time
async def test_a_slow_unkeyed_request_is_hedged_and_the_hedge_wins() -> None:
    transport = ScriptedTransport()
    publisher, core = await hedging_core(transport)
    transport.script.extend([transport.ok(delay=5.0), transport.ok(delay=0.02)])
    started = now()
    outcome = await core.forward(TOPIC, "", wire(b"slow"), 1)
    assert outcome.ok and outcome.hedge_won and outcome.attempts_sent == 2
    assert now() - started == pytest.approx(0.1 + 0.02)
    original, hedge = transport.calls[-2:]
    assert original.metadata[BATCH_ID_KEY] == hedge.metadata[BATCH_ID_KEY]
    assert decode_client_telemetry(hedge.metadata[CLIENT_TELEMETRY_KEY])[0] == 1
    assert publisher.stats().hedges_won == 1
    await publisher.shutdown()


@virtual_time
async def test_a_keyed_request_is_never_hedged() -> None:
    transport = ScriptedTransport()
    publisher, core = await hedging_core(transport)
    transport.script.append(transport.ok(delay=2.0))
    outcome = await core.forward(TOPIC, "k", wire(b"in order", ordering_key="k"), 1)
    assert outcome.ok and outcome.attempts_sent == 1 and outcome.hedges_sent == 0
    stats = publisher.stats()
    assert stats.unhedged_keyed_batches == 1 and stats.tokens_by_topic[TOPIC] == 1  # bucket left alone
    await publisher.shutdown()


@virtual_time
async def test_a_failure_is_the_outcome_with_the_status_not_an_exception() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().fail(StatusCode.NOT_FOUND, message="no topic"))
    publisher = AsyncPublisherClient(transport=transport)
    outcome = await core_of(publisher).forward(TOPIC, "", wire(b"x", b"y"), 2)
    assert isinstance(outcome.error, RpcError) and outcome.error.code is StatusCode.NOT_FOUND
    assert len(transport.calls) == 1  # NOT_FOUND is not retried
    assert publisher.stats().messages_failed == 2
    await publisher.shutdown()


@virtual_time
async def test_the_callers_deadline_shortens_the_total_timeout() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().fail(StatusCode.UNAVAILABLE, delay=0.05))
    publisher = AsyncPublisherClient(transport=transport, retry_settings=RetrySettings(total_timeout=600))
    started = now()
    outcome = await core_of(publisher).forward(TOPIC, "", wire(b"x"), 1, timeout=1.5)
    assert isinstance(outcome.error, PublishTimeoutError)
    assert now() - started <= 1.5
    assert outcome.attempts_sent > 1  # retried within the caller's deadline, not the publisher's
    await publisher.shutdown()


@virtual_time
async def test_cancelling_the_caller_cancels_the_attempts() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=10.0))
    publisher = AsyncPublisherClient(transport=transport)
    forwarding = asyncio.ensure_future(core_of(publisher).forward(TOPIC, "", wire(b"x"), 1))
    while not transport.calls:
        await asyncio.sleep(0.01)
    forwarding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await forwarding
    await asyncio.sleep(0.001)
    assert transport.calls[0].outcome == "cancelled"
    assert publisher.stats().messages_failed == 1
    await publisher.shutdown()


@virtual_time
async def test_bad_uses_are_refused() -> None:
    publisher = AsyncPublisherClient(transport=ScriptedTransport())
    core = core_of(publisher)
    with pytest.raises(ValueError, match="at least one message"):
        await core.forward(TOPIC, "", wire(), 0)
    await publisher.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        await core.forward(TOPIC, "", wire(b"x"), 1)


# ---- the caller's own token, against a real server with IAM enforcement --------------------------------

TOKENS: dict[str, Any] = {"t-publisher": "user:publisher@example.com", "t-nobody": "user:nobody@example.com"}
POLICY = {"bindings": [{"role": "roles/pubsub.admin", "members": ["user:publisher@example.com"]}]}


@pytest.fixture
def iam_server() -> Any:
    with LocalServer(in_memory=True, iam=IamConfig(TOKENS, POLICY)) as server:
        yield server


async def test_the_callers_authorization_goes_through_and_the_publishers_is_added_otherwise(
    iam_server: LocalServer,
) -> None:
    from hedgepub.admin import AdminClient

    with AdminClient(f"http://{iam_server.address}", access_token="t-publisher") as admin:
        admin.create_topic(TOPIC)
    # The publisher's own credentials are those of a caller who may not publish.
    publisher = AsyncPublisherClient(
        endpoint=f"http://{iam_server.address}", credentials=google.oauth2.credentials.Credentials("t-nobody")
    )
    core = core_of(publisher)
    refused = await core.forward(TOPIC, "", wire(b"as the publisher"), 1)
    assert isinstance(refused.error, RpcError) and refused.error.code is StatusCode.PERMISSION_DENIED
    caller = (("authorization", "Bearer t-publisher"),)
    published = await core.forward(TOPIC, "", wire(b"as the caller"), 1, caller)
    assert published.ok
    assert [m.data for m in iam_server.messages(TOPIC)] == [b"as the caller"]
    headers = core.auth_headers("https://pubsub.googleapis.com/google.pubsub.v1.Subscriber")
    assert headers is not None and (await headers.fresh())["authorization"] == "Bearer t-nobody"
    await publisher.shutdown()
