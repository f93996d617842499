"""Fault injection: the rule language, and the interceptor on a real gRPC server.

The interceptor tests run a small grpc.aio server of their own (raw-bytes handlers on the real method
paths, each handler counting its runs), so they check exactly what the interceptor does to each kind of
handler; tests/server/test_faults_local_server.py checks the same rules through ``LocalServer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import google.pubsub_v1
import grpc
import grpc.aio
import pytest
from google.iam.v1 import iam_policy_pb2

from hedgepub import StatusCode
from hedgepub.server._faults.delays import LatencyBucket, LatencyMix, StallWindows
from hedgepub.server._faults.injector import FaultInjector
from hedgepub.server._faults.rules import FaultRule
from hedgepub.server._methods import METHODS, WILDCARD, resolve_method

# -- the rule language ---------------------------------------------------------------------------------


def test_latency_mix_parses_weighted_delays_with_units() -> None:
    mix = LatencyMix.parse("95%:5ms,4%:300ms,1%:4s")
    assert mix.buckets == (LatencyBucket(0.95, 0.005), LatencyBucket(0.04, 0.3), LatencyBucket(0.01, 4.0))
    assert mix.no_delay_probability == pytest.approx(0.0)
    assert str(mix) == "95%:5ms,4%:300ms,1%:4s"
    assert LatencyMix.parse(str(mix)) == mix
    assert LatencyMix.parse(" 50% : 250us , 50% : 1.5s ").buckets == (
        LatencyBucket(0.5, 250e-6),
        LatencyBucket(0.5, 1.5),
    )


def test_latency_mix_remainder_gets_no_delay() -> None:
    mix = LatencyMix.parse("1%:4s")
    assert mix.no_delay_probability == pytest.approx(0.99)
    assert LatencyMix.parse("50ms") == LatencyMix.constant(0.05) == LatencyMix([(1.0, 0.05)])
    assert LatencyMix.parse("33.3%:1ms,33.3%:2ms,33.4%:3ms").no_delay_probability == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty latency mix"),
        ("95%:5", "bad duration '5'"),
        ("95%:5min", "bad duration '5min'"),
        ("95:5ms", "bad percentage '95'"),
        ("95%5ms", "expected PERCENT:DURATION"),
        ("60%:5ms,50%:1s", "more than 100%"),
        ("0%:5ms", "probability in (0, 1]"),
        ("-5%:5ms", "bad percentage"),
        ("10%:-5ms", "bad duration"),
    ],
)
def test_latency_mix_syntax_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LatencyMix.parse(spec)


def test_latency_mix_samples_in_proportion() -> None:
    import random

    mix = LatencyMix.parse("70%:1ms,20%:10ms")
    rng = random.Random(1)
    draws = Counter(mix.sample(rng) for _ in range(20_000))
    assert set(draws) == {0.001, 0.01, 0.0}
    assert draws[0.001] / 20_000 == pytest.approx(0.7, abs=0.02)
    assert draws[0.01] / 20_000 == pytest.approx(0.2, abs=0.02)
    assert draws[0.0] / 20_000 == pytest.approx(0.1, abs=0.02)


def test_fault_rule_parses_latency_and_errors_and_is_immutable() -> None:
    rule = FaultRule.parse("latency=95%:5ms,5%:300ms;error=UNAVAILABLE:20%,internal:1%")
    assert rule.latency == LatencyMix.parse("95%:5ms,5%:300ms")
    assert dict(rule.errors) == {StatusCode.INTERNAL: 0.01, StatusCode.UNAVAILABLE: 0.2}
    assert rule.error_probability == pytest.approx(0.21)
    assert FaultRule.parse(str(rule)) == rule
    assert hash(FaultRule.parse(str(rule))) == hash(rule)
    assert rule == FaultRule(
        latency="95%:5ms,5%:300ms", errors={grpc.StatusCode.UNAVAILABLE: 0.2, "INTERNAL": 0.01}
    )
    with pytest.raises(TypeError):
        rule.errors[StatusCode.ABORTED] = 0.5  # type: ignore[index]
    with pytest.raises(AttributeError):
        rule.latency = None  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"errors": {"UNAVAILABLE": 0.7, "INTERNAL": 0.4}}, ValueError, "more than 100%"),
        ({"errors": {"OK": 0.1}}, ValueError, "OK is not an error"),
        ({"errors": {"NOPE": 0.1}}, ValueError, "unknown status code 'NOPE'; valid codes are CANCELLED"),
        ({"errors": {"UNAVAILABLE": 1.5}}, ValueError, "error rate of UNAVAILABLE must be a probability"),
        ({"errors": {"UNAVAILABLE": "20%"}}, TypeError, "error rate of UNAVAILABLE"),
        ({"latency": 5}, TypeError, "latency must be a LatencyMix"),
    ],
)
def test_fault_rule_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        FaultRule(**kwargs)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("Publish", "bad fault spec 'Publish': expected METHOD:latency=MIX"),
        ("Publsh:latency=5ms", "unknown RPC method 'Publsh'; valid methods are '\\*' \\(all\\), CreateTopic"),
        ("Publish:latency=5", "bad duration '5'"),
        ("Publish:slow=5ms", "unknown fault kind 'slow'"),
        ("Publish:error=UNAVAILABLE", "expected CODE:PERCENT"),
        ("Publish:error=UNAVAILABLE:0.2", "bad percentage '0.2'"),
        ("Publish:error=UNAVAILABLE:20%,UNAVAILABLE:1%", "given twice"),
        ("Publish:latency=5ms;latency=6ms", "latency given twice"),
        ("Publish:error=BROKEN:1%", "unknown status code 'BROKEN'"),
    ],
)
def test_cli_spec_errors_name_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultInjector.parse([spec])


def test_cli_specs_and_file_combine(tmp_path: Path) -> None:
    faults_file = tmp_path / "faults.json"
    faults_file.write_text(
        json.dumps(
            {
                "Publish": {"latency": "95%:5ms,5%:300ms", "errors": {"UNAVAILABLE": 0.2}},
                "/google.pubsub.v1.Subscriber/StreamingPull": {"errors": {"INTERNAL": "1%"}},
            }
        )
    )
    injector = FaultInjector.parse(
        ["Publish:error=ABORTED:5%", "*:latency=1ms", "GetIamPolicy:latency=2ms;error=UNAVAILABLE:50%"],
        faults_file=faults_file,
    )
    assert dict(injector.rules) == {
        "Publish": FaultRule(latency="95%:5ms,5%:300ms", errors={"UNAVAILABLE": 0.2, "ABORTED": 0.05}),
        "StreamingPull": FaultRule(errors={"INTERNAL": 0.01}),
        "*": FaultRule(latency="1ms"),
        "GetIamPolicy": FaultRule(latency="2ms", errors={"UNAVAILABLE": 0.5}),
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must hold a JSON object"),
        ('{"Nope": {}}', "unknown RPC method 'Nope'"),
        ('{"Publish": {"latency": "5ms", "jitter": 1}}', "unknown fault rule keys \\['jitter'\\]"),
        ('{"Publish": {"errors": {"UNAVAILABLE": 2}}}', "must be a probability in"),
    ],
)
def test_faults_file_errors(tmp_path: Path, content: str, message: str) -> None:
    faults_file = tmp_path / "faults.json"
    faults_file.write_text(content)
    with pytest.raises(ValueError, match=message):
        FaultInjector.parse(faults_file=faults_file)


def test_method_names_short_full_and_wildcard() -> None:
    assert resolve_method("Publish") == "/google.pubsub.v1.Publisher/Publish"
    assert resolve_method("/google.pubsub.v1.Subscriber/StreamingPull") == (
        "/google.pubsub.v1.Subscriber/StreamingPull"
    )
    assert resolve_method("GetIamPolicy") == "/google.iam.v1.IAMPolicy/GetIamPolicy"
    assert resolve_method("*") == WILDCARD
    with pytest.raises(ValueError, match=r"valid methods are .*StreamingPull.*GetIamPolicy"):
        resolve_method("publish")


def test_method_table_matches_the_protocol_descriptors() -> None:
    metadata = json.loads((Path(google.pubsub_v1.__file__).parent / "gapic_metadata.json").read_text())
    expected = {
        f"/google.pubsub.v1.{service}/{rpc}"
        for service in ("Publisher", "Subscriber", "SchemaService")
        for rpc in metadata["services"][service]["clients"]["grpc"]["rpcs"]
    }
    iam = iam_policy_pb2.DESCRIPTOR.services_by_name["IAMPolicy"]
    expected |= {f"/{iam.full_name}/{method.name}" for method in iam.methods}
    assert set(METHODS.values()) == expected


def test_set_get_clear_and_repr() -> None:
    injector = FaultInjector()
    injector.set("/google.pubsub.v1.Publisher/Publish", "latency=5ms")
    injector.set("Pull", FaultRule(errors={StatusCode.UNAVAILABLE: 1.0}))
    assert injector.get("Publish") == FaultRule(latency="5ms")
    assert "Publish: latency=5ms" in repr(injector)
    injector.set("Publish", None)
    assert injector.get("Publish") is None
    assert set(injector.rules) == {"Pull"}
    injector.clear()
    assert dict(injector.rules) == {}
    with pytest.raises(ValueError, match="unknown RPC method"):
        injector.set("Publishh", "latency=5ms")
    with pytest.raises(TypeError):
        injector.set("Publish", 5)  # type: ignore[arg-type]


# -- the interceptor on a real server ------------------------------------------------------------------

PUBLISH = METHODS["Publish"]
STREAMING_PULL = METHODS["StreamingPull"]
PULL = METHODS["Pull"]
ACKNOWLEDGE = METHODS["Acknowledge"]
GET_TOPIC = METHODS["GetTopic"]


class _EchoServer:
    """A real grpc.aio server answering every method path with raw bytes, counting handler runs.

    StreamingPull is bidirectional as in the real protocol. To exercise every handler kind, Pull answers
    as a server stream (async generator), Acknowledge as a client stream, and GetTopic writes its
    responses with ``context.write``.
    """

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector
        self.runs: Counter[str] = Counter()
        self.server = grpc.aio.server(interceptors=[injector])
        self.server.add_generic_rpc_handlers([_EchoHandlers(self)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")


class _EchoHandlers(grpc.GenericRpcHandler):
    def __init__(self, owner: _EchoServer) -> None:
        self.owner = owner

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        runs = self.owner.runs
        method = details.method
        if method not in set(METHODS.values()) or method.endswith("/Seek"):
            # Seek is left out on purpose: an unimplemented method can still be targeted.
            return None

        if method == STREAMING_PULL:

            async def bidirectional(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                runs[method] += 1
                async for request in requests:
                    yield b"pulled:" + request

            return grpc.stream_stream_rpc_method_handler(bidirectional)
        if method == PULL:

            async def server_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
                runs[method] += 1
                yield b"one"
                yield b"two"

            return grpc.unary_stream_rpc_method_handler(server_stream)
        if method == GET_TOPIC:

            async def writer(request: bytes, context: Any) -> None:
                runs[method] += 1
                await context.write(b"written")

            return grpc.unary_stream_rpc_method_handler(writer)
        if method == ACKNOWLEDGE:

            async def client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
                runs[method] += 1
                return b"+".join([request async for request in requests])

            return grpc.stream_unary_rpc_method_handler(client_stream)

        async def unary(request: bytes, context: Any) -> bytes:
            runs[method] += 1
            return b"ok:" + request

        return grpc.unary_unary_rpc_method_handler(unary)


@pytest.fixture
async def echo() -> AsyncIterator[tuple[_EchoServer, grpc.aio.Channel]]:
    async with _serving(FaultInjector(seed=1234)) as served:
        yield served


class _ManualClock:
    """The injector's clock in the stall tests: time moves only when the test says so (:meth:`advance`),
    so a window ends when the test ends it, however slow the machine; calls still travel real gRPC."""

    def __init__(self) -> None:
        self.time = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.time + seconds, woken))
        await woken

    def call_later(self, delay: float, callback: Any) -> Any:
        raise AssertionError("the fault injector schedules no callbacks")

    def advance(self, seconds: float) -> None:
        self.time += seconds
        due = [woken for at, woken in self._sleepers if at <= self.time]
        self._sleepers = [(at, woken) for at, woken in self._sleepers if at > self.time]
        for woken in due:
            if not woken.done():
                woken.set_result(None)


async def _until(condition: Any, timeout: float = 30.0) -> None:
    """Wait for ``condition()`` to hold (the server's counts move as its calls do); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _serving(injector: FaultInjector) -> AsyncIterator[tuple[_EchoServer, grpc.aio.Channel]]:
    server = _EchoServer(injector)
    await server.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.server.stop(None)


async def _write_then_read(call: Any, requests: list[bytes]) -> list[bytes]:
    """Drive a client-streaming call: send ``requests`` (if any), then read to the end.

    With no requests the client neither writes nor half-closes. Calls that expect an injected error use
    that: a grpc.aio client whose write races with the server's early answer may report its own
    INTERNAL ("Internal error from Core") instead of the server's status.
    """
    for request in requests:
        await call.write(request)
    if requests:
        await call.done_writing()
    responses = []
    if hasattr(call, "read"):
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        code = await call.code()
        if code != grpc.StatusCode.OK:
            metadata = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(code, metadata, metadata, await call.details())
    else:
        responses.append(await call)
    return responses


async def _call(
    channel: grpc.aio.Channel, method: str, timeout: float | None = 5.0, *, expect_error: bool = False
) -> list[bytes]:
    """Call ``method`` with its kind in the echo server; return the responses."""
    requests = [] if expect_error else [b"a", b"b"]
    if method == STREAMING_PULL:
        return await _write_then_read(channel.stream_stream(method)(timeout=timeout), requests)
    if method in (PULL, GET_TOPIC):
        return [response async for response in channel.unary_stream(method)(b"x", timeout=timeout)]
    if method == ACKNOWLEDGE:
        return await _write_then_read(channel.stream_unary(method)(timeout=timeout), requests)
    return [await channel.unary_unary(method)(b"x", timeout=timeout)]


async def test_no_rule_returns_the_handler_unchanged() -> None:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    async def continuation(details: Any) -> grpc.RpcMethodHandler:
        return handler

    class Details(grpc.HandlerCallDetails):
        method = PUBLISH
        invocation_metadata = ()

    injector = FaultInjector({"Pull": FaultRule(latency="5ms")})
    assert await injector.intercept_service(continuation, Details()) is handler
    assert injector.counts.calls == 0


async def test_every_handler_kind_still_works_through_a_rule(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    server.injector.set("*", FaultRule(latency="1ms"))
    assert await _call(channel, PUBLISH) == [b"ok:x"]
    assert await _call(channel, STREAMING_PULL) == [b"pulled:a", b"pulled:b"]
    assert await _call(channel, PULL) == [b"one", b"two"]
    assert await _call(channel, GET_TOPIC) == [b"written"]
    assert await _call(channel, ACKNOWLEDGE) == [b"a+b"]
    counts = server.injector.counts
    assert {name: counts[name].delays for name in counts} == {
        name: {0.001: 1} for name in ("Publish", "StreamingPull", "Pull", "GetTopic", "Acknowledge")
    }


async def test_latency_lands_in_the_configured_mix(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    server.injector.set("Publish", FaultRule(latency="60%:1ms,40%:250ms"))
    calls = 60

    async def timed() -> float:
        started = time.perf_counter()
        await _call(channel, PUBLISH)
        return time.perf_counter() - started

    elapsed = await asyncio.gather(*(timed() for _ in range(calls)))
    counts = server.injector.counts["Publish"]
    assert counts.calls == calls
    assert set(counts.delays) == {0.001, 0.25} and sum(counts.delays.values()) == calls
    slow = counts.delays[0.25]
    # 40% of 60 is 24, with a standard deviation of about 3.8.
    assert 12 <= slow <= 36
    # Each call delayed 250 ms took that long at least (a busy machine only makes calls slower).
    assert sum(1 for seconds in elapsed if seconds >= 0.25) >= slow
    assert server.runs[PUBLISH] == calls


async def test_errors_by_code_at_their_rates(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    server.injector.set("Publish", "error=UNAVAILABLE:30%,INTERNAL:10%")
    calls = 400

    async def outcome() -> str:
        try:
            await _call(channel, PUBLISH)
        except grpc.aio.AioRpcError as error:
            assert error.details() == f"{error.code().name} injected on Publish by hedgepub fault injection"
            return error.code().name
        return "OK"

    outcomes = Counter(await asyncio.gather(*(outcome() for _ in range(calls))))
    counts = server.injector.counts["Publish"]
    assert counts.calls == calls
    assert dict(counts.errors) == {
        StatusCode.INTERNAL: outcomes["INTERNAL"],
        StatusCode.UNAVAILABLE: outcomes["UNAVAILABLE"],
    }
    assert counts.delays == {}
    # Within about four standard deviations of 120 and 40.
    assert 80 <= outcomes["UNAVAILABLE"] <= 160
    assert 16 <= outcomes["INTERNAL"] <= 64
    # An injected error never reaches the handler.
    assert server.runs[PUBLISH] == outcomes["OK"]


async def test_a_call_cancelled_during_the_delay_never_reaches_the_handler(
    echo: tuple[_EchoServer, Any],
) -> None:
    server, channel = echo
    # A delay far longer than the test: both calls end in it, however slow the machine.
    server.injector.set("Publish", FaultRule(latency="60s"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _call(channel, PUBLISH, timeout=0.05)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Explicit cancellation by the client, too.
    call = channel.unary_unary(PUBLISH)(b"x", timeout=5)
    await _until(lambda: server.injector.counts["Publish"].calls == 2)  # in its delay now
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The injector counts a call cancelled in its delay when it drops it: the handler never runs after.
    await _until(lambda: server.injector.counts["Publish"].cancelled_during_delay == 2)
    assert server.runs[PUBLISH] == 0
    counts = server.injector.counts["Publish"]
    assert (counts.calls, counts.cancelled_during_delay) == (2, 2)


async def test_a_rule_on_every_method_fires(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    for short_name, path in METHODS.items():
        server.injector.clear()
        server.injector.set(
            short_name, FaultRule(latency="1ms", errors={StatusCode.FAILED_PRECONDITION: 1.0})
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _call(channel, path, expect_error=True)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION, short_name
        assert "injected" in (raised.value.details() or "")
    counts = server.injector.counts
    assert set(counts) == set(METHODS)
    assert all(counts[name].errors == {StatusCode.FAILED_PRECONDITION: 1} for name in METHODS)
    assert all(counts[name].delays == {0.001: 1} for name in METHODS)
    assert sum(server.runs.values()) == 0
    # With the rule gone, Seek (not served here) answers UNIMPLEMENTED as before.
    server.injector.clear()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _call(channel, METHODS["Seek"], expect_error=True)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_the_wildcard_rule_covers_methods_without_their_own(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    server.injector.set("*", "error=UNAVAILABLE:100%")
    server.injector.set("Publish", "latency=1ms")
    assert await _call(channel, PUBLISH) == [b"ok:x"]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _call(channel, STREAMING_PULL, expect_error=True)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.injector.counts["StreamingPull"].errors == {StatusCode.UNAVAILABLE: 1}


async def test_rules_change_at_runtime_from_another_thread(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    assert await _call(channel, PUBLISH) == [b"ok:x"]

    def configure() -> None:
        server.injector.set("Publish", "error=RESOURCE_EXHAUSTED:100%")

    await asyncio.to_thread(configure)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _call(channel, PUBLISH)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.to_thread(server.injector.clear)
    assert await _call(channel, PUBLISH) == [b"ok:x"]
    assert server.injector.counts["Publish"].calls == 1
    server.injector.reset_counts()
    assert server.injector.counts["Publish"].calls == 0


async def test_concurrent_changes_and_calls_are_safe(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            server.injector.set("Publish", "latency=50%:1ms")
            server.injector.set("Publish", None)
            server.injector.counts  # noqa: B018 - snapshots race with the calls on purpose

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        results = await asyncio.gather(*(_call(channel, PUBLISH) for _ in range(100)))
    finally:
        stop.set()
        thread.join()
    assert results == [[b"ok:x"]] * 100


async def test_a_seed_makes_the_draws_repeatable(echo: tuple[_EchoServer, Any]) -> None:
    server, channel = echo
    server.injector.set("Publish", "error=UNAVAILABLE:50%")

    async def run() -> list[str]:
        outcomes = []
        for _ in range(30):
            try:
                await _call(channel, PUBLISH)
                outcomes.append("OK")
            except grpc.aio.AioRpcError as error:
                outcomes.append(error.code().name)
        return outcomes

    server.injector.seed(5)
    first = await run()
    server.injector.seed(5)
    assert await run() == first
    assert 5 <= first.count("UNAVAILABLE") <= 25


@pytest.mark.skipif(os.name != "posix", reason="debug request log checked on POSIX only")
async def test_requests_are_logged_at_debug_level(
    echo: tuple[_EchoServer, Any], caplog: pytest.LogCaptureFixture
) -> None:
    server, channel = echo
    server.injector.set("Publish", "error=ABORTED:100%")
    with caplog.at_level("DEBUG", logger="hedgepub.server.requests"):
        assert await _call(channel, GET_TOPIC) == [b"written"]
        with pytest.raises(grpc.aio.AioRpcError):
            await _call(channel, PUBLISH)

        def logged() -> list[str]:
            return [
                record.getMessage() for record in caplog.records if record.name == "hedgepub.server.requests"
            ]

        # The server logs when its handler has finished, which may come just after the client's answer.
        await _until(lambda: len(logged()) >= 2)
    messages = logged()
    assert any(message.startswith("GetTopic OK ") for message in messages), messages
    assert any(message.startswith("Publish ABORTED ") for message in messages), messages


# -- stall windows: slowness correlated in time ---------------------------------------------------------


def test_stall_windows_parse_validate_and_round_trip() -> None:
    windows = StallWindows.parse("500ms/5s")
    assert (windows.stall, windows.period, windows.phase) == (0.5, 5.0, None)
    assert str(windows) == "500ms/5s"
    assert StallWindows.parse("500ms/5s@1.5s") == StallWindows(0.5, 5.0, phase=1.5)
    assert StallWindows.parse(str(StallWindows(0.5, 5.0, 0.0))) == StallWindows(0.5, 5.0, 0.0)
    rule = FaultRule.parse("stall=250ms/2s;latency=1ms;error=UNAVAILABLE:1%")
    assert rule == FaultRule(latency="1ms", errors={"UNAVAILABLE": 0.01}, stall="250ms/2s")
    assert FaultRule.parse(str(rule)) == rule
    assert hash(FaultRule.parse(str(rule))) == hash(rule)
    assert rule != FaultRule(latency="1ms", errors={"UNAVAILABLE": 0.01})
    merged = FaultRule(stall="1s/5s").merged(FaultRule(latency="2ms"))
    assert merged == FaultRule(latency="2ms", stall="1s/5s")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("Publish:stall=500ms", "expected STALL/PERIOD"),
        ("Publish:stall=5s/500ms", "less than its period"),
        ("Publish:stall=5s/5s", "less than its period"),
        ("Publish:stall=0ms/5s", "more than 0 s"),
        ("Publish:stall=500ms/5s@6s", r"stall phase must be in \[0, period\)"),
        ("Publish:stall=500ms/5s@", "expected STALL/PERIOD"),
        ("Publish:stall=500/5s", "bad duration '500'"),
        ("Publish:stall=1s/5s;stall=1s/6s", "stall given twice"),
    ],
)
def test_stall_spec_errors_name_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultInjector.parse([spec])


def test_stall_windows_in_the_faults_file(tmp_path: Path) -> None:
    faults_file = tmp_path / "faults.json"
    faults_file.write_text(json.dumps({"Publish": {"stall": "500ms/5s", "latency": "1ms"}}))
    injector = FaultInjector.parse(["Publish:error=ABORTED:1%"], faults_file=faults_file)
    assert injector.get("Publish") == FaultRule(latency="1ms", errors={"ABORTED": 0.01}, stall="500ms/5s")
    faults_file.write_text(json.dumps({"Publish": {"stall": 5}}))
    with pytest.raises(ValueError, match="'stall' must be a string"):
        FaultInjector.parse(faults_file=faults_file)


def test_a_call_waits_until_its_window_ends() -> None:
    windows = StallWindows(0.5, 5.0)
    # Windows open at phase + n * period; a call in one waits for its end, others go straight on.
    assert windows.wait(elapsed=1.0, phase=1.0) == 0.5
    assert windows.wait(elapsed=1.2, phase=1.0) == pytest.approx(0.3)
    assert windows.wait(elapsed=1.5, phase=1.0) == 0.0
    assert windows.wait(elapsed=11.4, phase=1.0) == pytest.approx(0.1)
    assert windows.wait(elapsed=0.2, phase=4.8) == pytest.approx(0.1)  # the window that opened at -0.2
    assert windows.wait(elapsed=4.7, phase=4.8) == 0.0


def test_the_seed_sets_the_phase_of_windows_that_leave_it_open() -> None:
    windows = StallWindows.parse("500ms/5s")
    phases = {FaultInjector(seed=3).stall_phase(windows) for _ in range(3)}
    assert len(phases) == 1
    [phase] = phases
    assert 0 <= phase < 5.0
    assert FaultInjector(seed=4).stall_phase(windows) != phase
    # Rules with the same period stall together; an explicit phase wins over the seed.
    injector = FaultInjector(seed=3)
    assert injector.stall_phase(StallWindows.parse("100ms/5s")) == phase
    assert injector.stall_phase(StallWindows.parse("500ms/5s@2s")) == 2.0
    injector.seed(4)
    assert injector.stall_phase(windows) == FaultInjector(seed=4).stall_phase(windows)


async def test_every_call_in_a_window_is_held_until_it_ends() -> None:
    clock = _ManualClock()
    # The windows' origin is the clock's 0: one opens at once and lasts 300 ms.
    injector = FaultInjector(seed=1, clock=clock)
    injector.set("Publish", FaultRule(stall=StallWindows(0.3, 60.0, phase=0.0)))
    async with _serving(injector) as (server, channel):
        calls = []
        for arrival in (0.0, 0.05, 0.15):  # three calls arriving at three moments of the window
            clock.advance(arrival - clock.now())
            calls.append(asyncio.ensure_future(_call(channel, PUBLISH)))
            await _until(lambda: injector.counts["Publish"].stalled == len(calls))
        assert not any(call.done() for call in calls)
        assert server.runs[PUBLISH] == 0
        clock.advance(0.3 - clock.now())  # the window ends: all three go on together
        assert await asyncio.gather(*calls) == [[b"ok:x"]] * 3
        assert await _call(channel, PUBLISH) == [b"ok:x"]  # after the window: not held
        counts = injector.counts["Publish"]
    assert (counts.calls, counts.stalled, counts.delayed) == (4, 3, 0)
    assert server.injector.counts.stalled == 3
    assert server.runs[PUBLISH] == 4


async def test_a_call_cancelled_during_a_stall_never_reaches_the_handler(
    echo: tuple[_EchoServer, Any],
) -> None:
    server, channel = echo
    server.injector.seed(1)
    server.injector.set("Publish", "stall=60s/120s@0ms")  # a window far longer than the test
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _call(channel, PUBLISH, timeout=0.05)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _until(lambda: server.injector.counts["Publish"].cancelled_during_delay == 1)
    assert server.runs[PUBLISH] == 0
    counts = server.injector.counts["Publish"]
    assert (counts.calls, counts.stalled, counts.cancelled_during_delay) == (1, 1, 1)
