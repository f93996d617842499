"""Forwarding a Publish request that exists already: :class:`CoreForwarding`, the part of
:class:`~hedgepub._publisher.core._PublisherCore` that sends a caller's serialized request through the
publisher's hedging and retry path, and hands the outcome back rather than resolving futures.

``hedgepub proxy`` uses it: a client in any language sends its own ``PublishRequest``; the proxy reads the
topic and ordering keys and calls :meth:`CoreForwarding.forward` with the bytes as they came. The request
gets everything a batch of the publisher's own gets (the topic's token bucket, the hedge delay, the hedge
endpoints, the connection pool, the telemetry header, stats and OpenTelemetry), under the same rules: a
request with an ordering key is never hedged. It skips what belongs to the caller's side: batching,
flow control, and the ordering key's sequencing (the caller sends a key's next request after the
previous one's answer, as every Pub/Sub client does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hedgepub._clock import Clock
from hedgepub._exceptions import PublishError
from hedgepub._hedging.engine import BatchOutcome
from hedgepub._publisher.batch import Batch
from hedgepub._publisher.closing import ClientState
from hedgepub._publisher.observer import BatchObserver
from hedgepub._publisher.sender import AttemptCounts, BatchSender
from hedgepub._settings import RetrySettings
from hedgepub._transport.grpc import AuthHeaders, TokenRefresher

__all__ = ["CoreForwarding"]

#: The shortest total timeout a forwarded request is given: a caller whose deadline has all but passed
#: still gets one attempt, which gRPC fails at once with ``DEADLINE_EXCEEDED``.
MIN_FORWARD_TIMEOUT = 0.001


class CoreForwarding:
    """Sending ready-made requests (a base class of ``_PublisherCore``, which sets every attribute below
    in its constructor)."""

    state: ClientState
    refusal: str
    clock: Clock
    retry: RetrySettings
    _sender: BatchSender
    _observer: BatchObserver
    _id_prefix: str
    _batch_numbers: itertools.count[int]
    _credentials: Any
    _refresher: TokenRefresher | None

    if TYPE_CHECKING:

        def bind_running_loop(self) -> asyncio.AbstractEventLoop: ...

    async def forward(
        self,
        topic: str,
        ordering_key: str,
        wire: bytes,
        count: int,
        extra_metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
    ) -> BatchOutcome:
        """Publish ``wire``, a serialized ``PublishRequest`` of ``count`` messages (at least one) to
        ``topic``, with retries and hedges, and return its outcome (a failure too: ``outcome.error``).

        ``ordering_key`` is one of its messages' ordering keys (``""`` if none has one): a keyed request is
        never hedged. ``extra_metadata`` goes after the publisher's own on every attempt (the caller's
        ``authorization`` goes through as it is: the publisher's credentials then add none). ``timeout``
        (seconds; the caller's deadline) shortens the retry settings' ``total_timeout`` when it is the
        shorter. Cancelling the caller cancels every attempt. Raises ``RuntimeError`` once the publisher
        is shutting down, ``ValueError`` for a ``count`` below 1.
        """
        if self.state is not ClientState.OPEN:
            raise RuntimeError(self.refusal)
        if count < 1:
            raise ValueError(f"a forwarded request must hold at least one message; got {count!r}")
        self.bind_running_loop()
        retry = self.retry
        if timeout is not None and timeout < retry.total_timeout:
            retry = dataclasses.replace(retry, total_timeout=max(timeout, MIN_FORWARD_TIMEOUT))
        batch_id = f"{self._id_prefix}-{next(self._batch_numbers)}"
        batch = Batch.ready_made(
            topic, ordering_key, batch_id, wire, count, tuple(extra_metadata), now=self.clock.now
        )
        counts = AttemptCounts(started=self.clock.now())
        try:
            outcome = await self._sender.send(batch, counts, retry)
        except asyncio.CancelledError:
            cut = PublishError("the caller of a forwarded Publish went away (cancelled) before its answer")
            self._observer.batch_finished(batch, counts.cut_off(cut, self.clock.now()), None)
            raise
        except Exception as error:
            self._observer.batch_finished(batch, None, error)
            internal = PublishError(f"internal error while forwarding a Publish request: {error!r}")
            internal.__cause__ = error
            return counts.cut_off(internal, self.clock.now())
        self._observer.batch_finished(batch, outcome, None)
        return outcome

    def auth_headers(self, service_url: str) -> AuthHeaders | None:
        """Fresh authorization headers of the publisher's credentials for calls to ``service_url``
        (``https://HOST/SERVICE``), sharing the refreshes of its channels' token; ``None`` when the
        publisher has no credentials (an emulator or a local server without them)."""
        if self._credentials is None:
            return None
        return AuthHeaders(self._credentials, service_url, self._refresher)
