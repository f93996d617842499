"""A transport that answers from a script instead of the network: the publisher's test double.

``PublisherClient(transport=ScriptedTransport(...))`` publishes without a server; on the virtual-time loop
(:mod:`hedgepub.testing.virtual_time`) every delay in a script costs no real time.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hedgepub._exceptions import RpcError
from hedgepub._status import StatusCode
from hedgepub._transport.grpc import Metadata, PublishRequestPb, Transport


@dataclass
class ScriptedCall:
    """One Publish the scripted transport received: what was sent and how it ended."""

    #: The ``PublishRequest`` sent, parsed from the bytes the transport was given.
    request: Any
    metadata: dict[str, str]
    timeout: float
    outcome: str = "pending"  # "ok", "error", "cancelled" once finished


#: A step of a script: a result (message IDs, an exception to raise), or a callable producing one.
ScriptStep = Callable[[ScriptedCall], Awaitable[Sequence[str]]]


class ScriptedTransport(Transport):
    """A transport that answers from a script instead of the network, for unit tests.

    Each call takes the next step of ``script`` (or ``default`` when the script is empty): an async
    callable receiving the :class:`ScriptedCall`. Helpers build the usual steps: :meth:`ok` answers with
    one ID per message after an optional delay (on the running loop's clock, virtual in tests);
    :meth:`fail` raises an :class:`~hedgepub.RpcError` after a delay.
    """

    def __init__(self, script: Iterable[ScriptStep] = (), default: ScriptStep | None = None) -> None:
        self.script: collections.deque[ScriptStep] = collections.deque(script)
        self.default = default if default is not None else self.ok()
        self.calls: list[ScriptedCall] = []
        self.closed = False
        self._next_id = 0
        #: How a probe of this connection (by a publisher's connection pool, when it went silent) is
        #: answered: seconds until the answer, or None for no answer at all (the probe times out).
        self.probe_delay: float | None = 0.0
        #: The times (on the running loop's clock) probes were sent.
        self.probes: list[float] = []
        #: Whether the connection counts as ready (a test sets it false, as a gRPC channel still
        #: connecting is); the pool prefers a ready connection.
        self.ready = True

    def next_ids(self, count: int) -> list[str]:
        """``count`` fresh message IDs."""
        first = self._next_id
        self._next_id += count
        return [str(number) for number in range(first, first + count)]

    def ok(self, delay: float = 0.0) -> ScriptStep:
        """A step that succeeds after ``delay`` seconds."""

        async def step(call: ScriptedCall) -> Sequence[str]:
            if delay > 0:
                await asyncio.sleep(delay)
            return self.next_ids(len(call.request.messages))

        return step

    def fail(self, code: StatusCode, delay: float = 0.0, message: str = "scripted") -> ScriptStep:
        """A step that fails with ``code`` after ``delay`` seconds."""

        async def step(call: ScriptedCall) -> Sequence[str]:
            if delay > 0:
                await asyncio.sleep(delay)
            raise RpcError(code, message)

        return step

    async def publish(self, request: bytes, metadata: Metadata, timeout: float) -> list[str]:
        """Run the next step of the script, bounded by ``timeout`` like a real RPC."""
        call = ScriptedCall(
            request=PublishRequestPb.FromString(request), metadata=dict(metadata), timeout=timeout
        )
        self.calls.append(call)
        step = self.script.popleft() if self.script else self.default
        try:
            ids = await asyncio.wait_for(step(call), timeout)
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        except TimeoutError:
            call.outcome = "error"
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "scripted deadline") from None
        except BaseException:
            call.outcome = "error"
            raise
        call.outcome = "ok"
        return list(ids)

    def connected(self) -> bool | None:
        """A scripted connection cannot tell."""
        return None

    def keep_connected(self) -> bool:
        """No connection to keep: the pool runs no upkeep timer for it (a virtual clock stays still)."""
        return False

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the test made it :attr:`ready` (at once: nothing connects a scripted transport)."""
        return self.ready

    async def probe(self, timeout: float) -> bool:
        """Answer a probe after :attr:`probe_delay` seconds, if that is within ``timeout``."""
        loop = asyncio.get_running_loop()
        self.probes.append(loop.time())
        delay = self.probe_delay
        if delay is None or delay > timeout:
            await asyncio.sleep(timeout)
            return False
        if delay > 0:
            await asyncio.sleep(delay)
        return True

    async def close(self) -> None:
        """Mark the transport closed."""
        self.closed = True
