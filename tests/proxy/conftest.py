"""Fixtures of the proxy tests: a real local server on an ephemeral port, the proxy in front of it, and
``PUBSUB_EMULATOR_HOST`` pointing the official clients at the proxy."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from hedgepub import HedgingSettings
from hedgepub._wire import CLIENT_TELEMETRY_KEY, EMULATOR_HOST_ENV, decode_client_telemetry
from hedgepub.proxy import Proxy
from hedgepub.server import FaultInjector, LocalServer
from hedgepub.server._api.handlers import behavior_of, rebuilt

PROJECT = "proxy-project"
PUBLISH = "/google.pubsub.v1.Publisher/Publish"
_names = itertools.count()


def unique(kind: str) -> str:
    """A fresh resource name of ``kind`` (``"topics"``, ``"subscriptions"``)."""
    return f"projects/{PROJECT}/{kind}/{kind[:-1]}-{next(_names)}"


class AttemptRecorder(FaultInjector):
    """The server's fault injector, also noting each Publish attempt that arrives (its hedge number, from
    the telemetry header; its ordering keys) and holding the original attempt (number 0) of any request
    whose first message's data starts with ``slow`` until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__()
        #: (hedged_attempt_count, ordering keys of the request's messages), in order of arrival; -1 for a
        #: request without the telemetry header.
        self.attempts: list[tuple[int, frozenset[str]]] = []
        self.held_seconds = 30.0

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        import asyncio

        handler = await super().intercept_service(continuation, handler_call_details)
        if handler_call_details.method != PUBLISH or handler is None:
            return handler
        metadata = dict(handler_call_details.invocation_metadata)
        telemetry = metadata.get(CLIENT_TELEMETRY_KEY)  # none on a request the proxy passed as it is
        attempt = -1 if telemetry is None else decode_client_telemetry(telemetry)[0]
        behavior = behavior_of(handler)

        async def recorded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            messages = getattr(request, "messages", ())  # none in a request that did not parse
            self.attempts.append((attempt, frozenset(m.ordering_key for m in messages)))
            if attempt == 0 and messages and messages[0].data.startswith(b"slow"):
                await asyncio.sleep(self.held_seconds)  # cancelled when the caller gives up
            return await behavior(request, context)

        return rebuilt(handler, recorded)


#: The proxy's hedging in these tests: a hedge 100 ms after the original, a bucket that 5 successes fill.
HEDGING = HedgingSettings(hedge_delay=0.1, max_tokens=10, refill_ratio=0.2)


@pytest.fixture
def recorder() -> AttemptRecorder:
    return AttemptRecorder()


@pytest.fixture
def upstream(recorder: AttemptRecorder) -> Iterator[LocalServer]:
    """A real in-memory server on an ephemeral port, with :class:`AttemptRecorder` as its injector."""
    with LocalServer(in_memory=True, faults=recorder) as server:
        yield server


@pytest.fixture
def proxy(upstream: LocalServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    """The proxy in front of ``upstream``, hedging with :data:`HEDGING`; clients find it through
    ``PUBSUB_EMULATOR_HOST``."""
    with Proxy(upstream.address, hedging_settings=HEDGING) as running:
        monkeypatch.setenv(EMULATOR_HOST_ENV, running.address)
        yield running
