"""Sending one batch: the hedging engine decides when each attempt goes, the routes where it goes.

:class:`BatchSender` runs a sealed batch through :func:`hedgepub._hedging.engine.run_batch` with the
publisher's retry and hedging settings, the token bucket of the batch's topic and the hedge delay source.
Each attempt goes to the endpoint its attempt number is routed to (:mod:`hedgepub._publisher.routes`),
with the metadata of docs/hedging.md (rule 8), inside an OpenTelemetry span when telemetry is on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hedgepub._clock import Clock
from hedgepub._exceptions import PublishError, PublishTimeoutError, RpcError
from hedgepub._hedging.budget import HedgingBudget
from hedgepub._hedging.engine import BatchOutcome, run_batch
from hedgepub._publisher.batch import Batch
from hedgepub._publisher.routes import EndpointRoutes
from hedgepub._settings import HedgingSettings, RetrySettings
from hedgepub._status import StatusCode
from hedgepub._transport.grpc import request_metadata
from hedgepub._transport.pool import ConnectionPool, Lease

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry


@dataclass
class AttemptCounts:
    """The attempts of one batch counted as they go out, for a batch cut off before the engine's outcome,
    and for saying what is pending (:meth:`describe`)."""

    started: float
    attempts: int = 0
    hedges: int = 0
    in_flight: int = 0
    last_error: str | None = None
    #: the endpoint of the latest failed attempt, and whether it could not be reached
    last_endpoint: str | None = None
    last_unreachable: bool = False

    def describe(self, now: float) -> str:
        """``4 attempts in 3.2 s, 1 in flight; last error from ...: ...``."""
        text = (
            f"{self.attempts} attempt{'s' if self.attempts != 1 else ''} sent in {now - self.started:.1f} s, "
            f"{self.in_flight} in flight"
        )
        if self.last_error is not None:
            reach = ", which cannot be reached" if self.last_unreachable else ""
            text += f"; last error from {self.last_endpoint}{reach}: {self.last_error}"
        return text

    def cut_off(self, error: PublishError, now: float) -> BatchOutcome:
        """The outcome of a batch that ``shutdown(timeout)`` cut off at ``now`` with ``error``."""
        return BatchOutcome(
            message_ids=None,
            error=error,
            winner_attempt=None,
            attempts_sent=self.attempts,
            hedges_sent=self.hedges,
            hedges_skipped=0,  # known only to the engine
            latency=now - self.started,
        )


class BatchSender:
    """Sends batches through the hedging engine over the publisher's endpoints (on its loop)."""

    def __init__(
        self,
        *,
        routes: EndpointRoutes,
        retry: RetrySettings,
        hedging: HedgingSettings | None,
        budget: HedgingBudget,
        clock: Clock,
        telemetry: PublisherTelemetry | None,
    ) -> None:
        self.routes = routes
        self.retry = retry
        self.hedging = hedging
        self.budget = budget
        self.clock = clock
        self.telemetry = telemetry

    async def send(
        self, batch: Batch, counts: AttemptCounts, retry: RetrySettings | None = None
    ) -> BatchOutcome:
        """Publish ``batch`` with retries and hedges; its outcome (a failure too) is returned, not raised.

        ``counts`` is kept up to date as attempts go out. Cancelling the caller cancels every attempt.
        ``retry`` replaces the publisher's retry settings for this batch (a forwarded request's shorter
        deadline).
        """
        routes = self.routes
        clock = self.clock
        routes.open_all()  # every endpoint's channel opens with the first batch, hedge endpoints too
        # The request's bytes for transports that send bytes (gRPC), parsed once for any other.
        wire = batch.wire()
        topic = batch.topic
        batch_id = batch.batch_id
        extra_metadata = batch.extra_metadata
        # Rule 8: wall-clock time (the service compares it across clients), taken once per batch.
        started = time.time()
        headers: dict[int, tuple[tuple[str, str], ...]] = {}

        # Rule 24: where this batch's running attempts are (their leases, by endpoint), where its original
        # last failed, and where it was won (rule 26: a loser's connection that gave nothing back since).
        running: dict[Lease, int] = {}
        failed_on: list[tuple[int, int] | None] = [None]
        won_on: list[tuple[int, int] | None] = [None]

        async def attempt(attempt_number: int, timeout: float) -> Sequence[str]:
            counts.attempts += 1
            if attempt_number:
                counts.hedges += 1
            # The engine says when; the attempt number says which endpoint (see hedgepub._publisher.routes)
            # and the endpoint's pool which connection (see hedgepub._transport.pool).
            index = routes.index_for(attempt_number)
            recorder = routes.recorder(index)
            sent_at = clock.now()
            recorder.started()
            counts.in_flight += 1
            lease: Lease | None = None
            pool: ConnectionPool | None = None
            answered = False
            try:
                pool = routes.pool(index)
                if pool.size == 1:
                    member = 0
                else:
                    avoid: set[int] = set()
                    if running:  # most attempts are a batch's only one: nothing to avoid
                        avoid = {other.member for other, where in running.items() if where == index}
                    if attempt_number == 0 and failed_on[0] is not None and failed_on[0][0] == index:
                        avoid.add(failed_on[0][1])
                    # A ready connection (the usual case) without the coroutine that waiting would take.
                    ready = pool.pick_ready(avoid)
                    member = await pool.choose(avoid, timeout) if ready is None else ready
                lease = pool.start(member)
                running[lease] = index
                transport = lease.transport
                metadata = headers.get(attempt_number)
                if metadata is None:  # retries of the original send the very same metadata
                    metadata = headers[attempt_number] = (
                        request_metadata(topic, batch_id, attempt_number, started) + extra_metadata
                    )
                ids = await transport.publish(wire, metadata, timeout)
                answered = True
            except asyncio.CancelledError:
                winner = won_on[0]
                if lease is not None and pool is not None and winner is not None and winner[0] == index:
                    pool.lost(lease, winner[1])
                raise
            except Exception as error:  # not CancelledError: a loser cancelled by the engine did not fail
                connected = pool.connected(lease.member) if pool is not None and lease is not None else None
                counts.last_error, counts.last_endpoint = str(error), recorder.description
                counts.last_unreachable = connected is False
                recorder.failed(error, connected, clock.now())
                if lease is not None and pool is not None:
                    answered = _answered_by_server(error, connected)
                    if attempt_number == 0:
                        failed_on[0] = (index, lease.member)
                raise
            finally:
                if lease is not None and pool is not None:
                    pool.ended(lease, answered)  # an answer (IDs, or the server's status) makes it warm
                    del running[lease]
                recorder.ended()
                counts.in_flight -= 1
            won_on[0] = (index, lease.member)
            now = clock.now()
            recorder.answered(now - sent_at, now)
            return ids

        if self.telemetry is not None:
            attempt = self.telemetry.start_batch(batch).wrap(  # type: ignore[assignment]  # called the same way
                attempt, lambda n: routes.labels[routes.index_for(n)]
            )
        batch.progress = counts
        # A batch with an ordering key is never hedged, and leaves its topic's bucket alone (neither spent
        # nor refilled): a hedged copy stored late would land behind the key's next batch (rule 23). Its
        # latency still feeds the adaptive delay, which measures the service.
        keyed = bool(batch.ordering_key)
        outcome = await run_batch(
            attempt,
            message_count=batch.message_count,
            retry=self.retry if retry is None else retry,
            hedging=None if keyed else self.hedging,
            bucket=None if keyed else self.budget.bucket_for(topic),
            clock=clock,
            delay_source=self.budget.delay_source,
        )
        if isinstance(outcome.error, PublishTimeoutError):
            # The engine knows attempts and the last error; the batch knows what was pending and where.
            timeout = outcome.error
            told = PublishTimeoutError(
                f"{timeout.message}: {batch.describe_contents()} to {routes.recorder(0).description}",
                timeout.last_error,
            )
            told.__cause__ = timeout.__cause__
            outcome = dataclasses.replace(outcome, error=told)
        return outcome


def _answered_by_server(error: BaseException, connected: bool | None) -> bool:
    """Whether a failed attempt's error came from the other end of its connection: a status, on a
    connection that was connected, other than the timeouts and cancellations gRPC makes up itself."""
    return (
        isinstance(error, RpcError)
        and connected is not False
        and error.code not in (StatusCode.DEADLINE_EXCEEDED, StatusCode.CANCELLED)
    )
