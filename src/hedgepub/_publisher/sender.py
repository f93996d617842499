"""Sending one batch: the hedging engine decides when each attempt goes, the routes where it goes.

:class:`BatchSender` runs a sealed batch through :func:`hedgepub._hedging.engine.run_batch` with the
publisher's retry and hedging settings, the token bucket of the batch's topic and the hedge delay source.
Each attempt goes to the endpoint its attempt number is routed to (:mod:`hedgepub._publisher.routes`),
with the metadata of docs/hedging.md (rule 8), inside an OpenTelemetry span when telemetry is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hedgepub._clock import Clock
from hedgepub._exceptions import PublishError
from hedgepub._hedging.budget import HedgingBudget
from hedgepub._hedging.engine import BatchOutcome, run_batch
from hedgepub._publisher.batch import Batch
from hedgepub._publisher.routes import EndpointRoutes
from hedgepub._settings import HedgingSettings, RetrySettings
from hedgepub._transport.grpc import request_metadata

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry


@dataclass
class AttemptCounts:
    """The attempts of one batch counted as they go out, for a batch cut off before the engine's outcome."""

    started: float
    attempts: int = 0
    hedges: int = 0

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

    async def send(self, batch: Batch, counts: AttemptCounts) -> BatchOutcome:
        """Publish ``batch`` with retries and hedges; its outcome (a failure too) is returned, not raised.

        ``counts`` is kept up to date as attempts go out. Cancelling the caller cancels every attempt.
        """
        routes = self.routes
        clock = self.clock
        routes.open_all()  # every endpoint's channel opens with the first batch, hedge endpoints too
        request = batch.request
        topic = batch.topic
        batch_id = batch.batch_id
        # Rule 8: wall-clock time (the service compares it across clients), taken once per batch.
        started = time.time()
        headers: dict[int, tuple[tuple[str, str], ...]] = {}

        async def attempt(attempt_number: int, timeout: float) -> list[str]:
            counts.attempts += 1
            if attempt_number:
                counts.hedges += 1
            # The engine says when; the attempt number says where (see hedgepub._publisher.routes).
            index = routes.index_for(attempt_number)
            recorder = routes.recorder(index)
            sent_at = clock.now()
            try:
                transport = routes.transport(index)
                metadata = headers.get(attempt_number)
                if metadata is None:  # retries of the original send the very same metadata
                    metadata = headers[attempt_number] = request_metadata(
                        topic, batch_id, attempt_number, started
                    )
                ids = await transport.publish(request, metadata, timeout)
            except Exception:  # not CancelledError: a loser cancelled by the engine did not fail
                recorder.failed()
                raise
            recorder.answered(clock.now() - sent_at)
            return ids

        if self.telemetry is not None:
            attempt = self.telemetry.start_batch(batch).wrap(
                attempt, lambda n: routes.labels[routes.index_for(n)]
            )
        return await run_batch(
            attempt,
            message_count=len(batch.futures),
            retry=self.retry,
            hedging=self.hedging,
            bucket=self.budget.bucket_for(topic),
            clock=clock,
            delay_source=self.budget.delay_source,
        )
