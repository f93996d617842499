"""The transport: endpoint selection, channel options, status mapping, metadata, the Publish RPC."""

from __future__ import annotations

import asyncio
import re

import google.auth.credentials
import grpc
import grpc.aio
import pytest

from hedgepub import RpcError, StatusCode
from hedgepub._transport.grpc import (
    CHANNEL_OPTIONS,
    DEFAULT_ENDPOINT,
    ChannelTarget,
    GrpcTransport,
    PublishRequestPb,
    PubsubMessagePb,
    create_channel,
    map_rpc_error,
    parse_endpoint,
    request_metadata,
    resolve_endpoint,
)
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import run_virtual


class _FakeGrpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("grpc_code", list(grpc.StatusCode))
def test_every_grpc_status_code_is_mapped(grpc_code: grpc.StatusCode) -> None:
    error = map_rpc_error(_FakeGrpcError(grpc_code, "why"))
    assert isinstance(error, RpcError)
    expected = StatusCode.UNKNOWN if grpc_code is grpc.StatusCode.OK else StatusCode[grpc_code.name]
    assert error.code is expected
    assert error.details == "why"


def test_status_codes_agree_in_number() -> None:
    assert {code.name: code.value[0] for code in grpc.StatusCode} == {c.name: c.value for c in StatusCode}


def test_metadata_ties_the_attempt_to_its_batch() -> None:
    metadata = dict(request_metadata("projects/p/topics/t", "batch-7", 2))
    assert metadata == {
        "x-goog-request-params": "topic=projects/p/topics/t",
        "x-goog-pubsub-client-telemetry": "CgIIAg==",  # hedged_attempt_count 2, no start time
        "hedgepub-batch-id": "batch-7",
    }


@pytest.mark.parametrize(("attempt", "expected"), [(0, "CgA="), (1, "CgIIAQ==")])
def test_the_telemetry_header_has_the_references_bytes(attempt: int, expected: str) -> None:
    assert (
        dict(request_metadata("projects/p/topics/t", "b", attempt))["x-goog-pubsub-client-telemetry"]
        == expected
    )


@pytest.mark.parametrize(
    ("endpoint", "credentials", "environ", "expected"),
    [
        ("localhost:8085", None, {"PUBSUB_EMULATOR_HOST": "other:1"}, ChannelTarget("localhost:8085", False)),
        ("example.test:443", None, {}, ChannelTarget("example.test:443", True)),
        (
            "us-east1-pubsub.googleapis.com",
            None,
            {},
            ChannelTarget("us-east1-pubsub.googleapis.com:443", True),
        ),
        ("https://example.test", None, {}, ChannelTarget("example.test:443", True)),
        ("https://example.test:8443", None, {}, ChannelTarget("example.test:8443", True)),
        ("http://127.0.0.1:9000", None, {}, ChannelTarget("127.0.0.1:9000", False)),
        ("127.0.0.1:9000", object(), {}, ChannelTarget("127.0.0.1:9000", True)),
        (None, None, {"PUBSUB_EMULATOR_HOST": "127.0.0.1:8681"}, ChannelTarget("127.0.0.1:8681", False)),
        (None, None, {}, ChannelTarget(DEFAULT_ENDPOINT, True)),
        ("http://localhost", None, {}, ChannelTarget("localhost:80", False)),
        ("http://[::1]:8085/", None, {}, ChannelTarget("[::1]:8085", False)),
        ("[::1]:8085", None, {}, ChannelTarget("[::1]:8085", False)),
        ("unix:/tmp/pubsub.sock", None, {}, ChannelTarget("unix:/tmp/pubsub.sock", False)),
    ],
)
def test_endpoint_selection(
    endpoint: str | None, credentials: object, environ: dict, expected: ChannelTarget
) -> None:
    assert resolve_endpoint(endpoint, credentials=credentials, environ=environ) == expected


@pytest.mark.parametrize(
    "endpoint",
    [
        "ftp://example.test:21",
        "http://",
        "https://:443",
        "example.test:http",
        "example.test:0",
        "example.test:70000",
        "http://example.test:8085/v1",
        "host name:8085",
        "[::1",
        "[::1]8085",
    ],
)
def test_a_malformed_endpoint_is_refused_naming_the_accepted_forms(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT, http://HOST:PORT .* or https://HOST\[:PORT\]"):
        parse_endpoint(endpoint)


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("localhost", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("pubsub-emulator", "pubsub-emulator"),
        ("[::1]", "[::1]"),
        ("pubsub.internal.example", "pubsub.internal.example"),
    ],
)
def test_a_bare_host_other_than_googles_says_its_port_is_missing(endpoint: str, host: str) -> None:
    # It meant TLS on 443 and needed Google credentials: DefaultCredentialsError, the port never named.
    with pytest.raises(ValueError, match=rf"names no port: give HOST:PORT \('{re.escape(host)}:8085'"):
        resolve_endpoint(endpoint, environ={})
    assert resolve_endpoint(f"https://{endpoint}", environ={}) == ChannelTarget(f"{host}:443", True)


def test_an_emulator_host_without_a_port_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=r"PUBSUB_EMULATOR_HOST='localhost' names no port"):
        resolve_endpoint(environ={"PUBSUB_EMULATOR_HOST": "localhost"})


def test_channel_allows_messages_above_ten_megabytes() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_send_message_length"] > 10_000_000
    assert options["grpc.max_receive_message_length"] > 10_000_000


def test_secure_channel_with_given_credentials() -> None:
    async def scenario() -> None:
        credentials = google.auth.credentials.AnonymousCredentials()
        channel = create_channel(ChannelTarget("127.0.0.1:1", secure=True), credentials)
        assert isinstance(channel, grpc.aio.Channel)
        await channel.close()

    asyncio.run(scenario())


def _request(topic: str, count: int) -> bytes:
    request = PublishRequestPb(topic=topic, messages=[PubsubMessagePb(data=b"m%d" % i) for i in range(count)])
    return request.SerializeToString()


def test_grpc_transport_publishes_and_maps_errors(server, topic: str) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        transport = GrpcTransport.connect(server.address)
        try:
            ids = await transport.publish(_request(topic, 3), request_metadata(topic, "b", 0), 5.0)
            assert len(ids) == 3 and len(set(ids)) == 3
            missing = topic + "-missing"
            with pytest.raises(RpcError) as caught:
                await transport.publish(_request(missing, 1), request_metadata(missing, "b", 0), 5.0)
            assert caught.value.code is StatusCode.NOT_FOUND
            assert isinstance(caught.value.__cause__, grpc.RpcError)
        finally:
            await transport.close()

    asyncio.run(scenario())
    assert [message.data for message in server.messages(topic)] == [b"m0", b"m1", b"m2"]


def test_cancelling_the_caller_cancels_the_rpc(server, topic: str) -> None:  # type: ignore[no-untyped-def]
    from hedgepub.server import FaultRule

    server.faults.set("Publish", FaultRule(latency="100%:5s"))

    async def scenario() -> None:
        transport = GrpcTransport.connect(server.address)
        try:
            task = asyncio.ensure_future(transport.publish(_request(topic, 1), (), 10.0))
            for _ in range(500):
                if server.faults.counts.get("Publish") and server.faults.counts["Publish"].delayed:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):
                if server.faults.counts["Publish"].cancelled_during_delay:
                    break
                await asyncio.sleep(0.01)
        finally:
            await transport.close()

    asyncio.run(scenario())
    assert server.faults.counts["Publish"].cancelled_during_delay == 1
    assert server.messages(topic) == []


def test_scripted_transport_follows_its_script() -> None:
    async def scenario() -> None:
        transport = ScriptedTransport()
        transport.script.extend([transport.fail(StatusCode.UNAVAILABLE, delay=1.0), transport.ok(delay=2.0)])
        with pytest.raises(RpcError):
            await transport.publish(_request("t", 2), (("hedgepub-batch-id", "b-0"),), 5.0)
        assert asyncio.get_running_loop().time() == 1.0
        assert await transport.publish(_request("t", 2), (), 5.0) == ["0", "1"]
        assert asyncio.get_running_loop().time() == 3.0
        transport.script.append(transport.ok(delay=2.0))
        with pytest.raises(RpcError) as caught:
            await transport.publish(_request("t", 1), (), 0.5)
        assert caught.value.code is StatusCode.DEADLINE_EXCEEDED
        assert asyncio.get_running_loop().time() == 3.5
        assert [call.outcome for call in transport.calls] == ["error", "ok", "error"]
        assert transport.calls[0].metadata == {"hedgepub-batch-id": "b-0"}

    run_virtual(scenario())
