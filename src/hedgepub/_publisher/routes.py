"""Hedges to other endpoints: where each attempt of a batch goes, and what each endpoint did.

The hedging engine decides *when* an attempt is sent and stays a pure decision core; this module decides
*where*, from the attempt number alone. The original and its retries (attempt 0) always go to the
primary endpoint. With ``hedge_endpoints`` given, hedge ``k`` goes to ``hedge_endpoints[(k - 1) % n]``:
the first hedge to the first listed endpoint, the next to the next, round again after the last. Without
them every hedge goes to the primary, as plain hedging does. Every endpoint shares the publisher's
credentials, token bucket and the rules of docs/hedging.md; a hedge endpoint that cannot be reached
answers ``UNAVAILABLE`` (or times out), which ends that hedge quietly like any retryable hedge failure
and never fails the batch while the primary may still answer.

Why a second endpoint helps: slowness that is correlated in time at one place (a front end failing over
or pausing) holds the hedge as long as the original when both go there; a hedge to another region
escapes it, as "The Tail at Scale" sends its backup request to another replica.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hedgepub._exceptions import RpcError
from hedgepub._publisher.stats import EndpointStats, latency_histogram, latency_micros, max_ms, percentile_ms
from hedgepub._status import StatusCode
from hedgepub._transport.grpc import Transport
from hedgepub._transport.pool import ConnectionPool

if TYPE_CHECKING:
    from hedgepub._hedging.engine import BatchOutcome
    from hedgepub._publisher.batch import Batch

_LOGGER = logging.getLogger("hedgepub")


class _EndpointRecorder:
    """The counters and the reachability of one endpoint; safe to update and read from any thread.

    Reachability is what the log says about an endpoint (logger ``hedgepub``): an attempt that fails
    while its channel is not connected (refused, no route, DNS, TLS, a silent host) makes the endpoint
    *unreachable*, logged once at WARNING with its address and the status; the next attempt that gets
    an answer (message IDs, or a status the server sent) makes it reachable again, logged once at WARNING
    too. Every failed attempt is logged at DEBUG. A server answering errors (injected faults, load
    shedding) is reachable: that is the retry policy's business, not the connection's.
    """

    __slots__ = (
        "_histogram",
        "_lock",
        "attempts_failed",
        "attempts_in_flight",
        "attempts_sent",
        "description",
        "ever_reached",
        "failures_unreachable",
        "hedges_sent",
        "last_error",
        "unreachable_since",
        "wins",
    )

    def __init__(self, description: str = "") -> None:
        self._lock = threading.Lock()
        # In the layout of the publisher's batch latencies.
        self._histogram = latency_histogram()
        #: How log lines and errors name the endpoint: ``http://host:port (from PUBSUB_EMULATOR_HOST)``.
        self.description = description
        self.attempts_sent = 0
        self.hedges_sent = 0
        self.attempts_failed = 0
        self.attempts_in_flight = 0
        self.wins = 0
        self.last_error: str | None = None
        #: clock time of the first failure of the current unreachable spell; None while reachable
        self.unreachable_since: float | None = None
        self.failures_unreachable = 0
        #: whether any attempt ever reached it (answered, or failed on a connected connection)
        self.ever_reached = False

    def sent(self, attempts: int, hedges: int) -> None:
        with self._lock:
            self.attempts_sent += attempts
            self.hedges_sent += hedges

    def started(self) -> None:
        with self._lock:
            self.attempts_in_flight += 1

    def ended(self) -> None:
        with self._lock:
            self.attempts_in_flight -= 1

    def answered(self, seconds: float, now: float | None = None) -> None:
        micros = latency_micros(seconds)
        with self._lock:
            self._histogram.record_value(micros)
            recovered = self._reached(now)
        if recovered is not None:
            self._log_recovery(*recovered)

    def failed(
        self, error: BaseException | None = None, connected: bool | None = None, now: float = 0.0
    ) -> None:
        """Count a failed attempt; ``connected`` is whether its channel was connected when it failed
        (None: the transport cannot tell, so the failure says nothing about reachability)."""
        text = str(error) if error is not None else "failed"
        became_unreachable = False
        recovered = None
        with self._lock:
            self.attempts_failed += 1
            self.last_error = text
            if connected is False:
                self.failures_unreachable += 1
                if self.unreachable_since is None:
                    self.unreachable_since = now
                    became_unreachable = True
            elif connected:
                recovered = self._reached(now)
        _LOGGER.debug("hedgepub: attempt to %s failed: %s", self.description, text)
        if became_unreachable:
            _LOGGER.warning(
                "hedgepub: cannot reach the Pub/Sub endpoint %s: %s; publishing to it is retried until each "
                "batch's total timeout",
                self.description,
                text,
            )
        if recovered is not None:
            self._log_recovery(*recovered)

    def _reached(self, now: float | None) -> tuple[float, int] | None:
        """The endpoint answered: end an unreachable spell, returning (its length, its failures)."""
        self.ever_reached = True
        if self.unreachable_since is None:
            return None
        spell = 0.0 if now is None else max(0.0, now - self.unreachable_since)
        failures, self.failures_unreachable, self.unreachable_since = self.failures_unreachable, 0, None
        return spell, failures

    def _log_recovery(self, spell: float, failures: int) -> None:
        _LOGGER.warning(
            "hedgepub: the Pub/Sub endpoint %s answers again, after %.1f s and %d attempts that could not "
            "reach it",
            self.description,
            spell,
            failures,
        )

    def won(self) -> None:
        with self._lock:
            self.wins += 1

    def snapshot(self) -> EndpointStats:
        with self._lock:
            histogram = self._histogram
            return EndpointStats(
                attempts_sent=self.attempts_sent,
                hedges_sent=self.hedges_sent,
                attempts_failed=self.attempts_failed,
                wins=self.wins,
                p50_ms=percentile_ms(histogram, 50),
                p90_ms=percentile_ms(histogram, 90),
                p99_ms=percentile_ms(histogram, 99),
                max_ms=max_ms(histogram),
                attempts_in_flight=self.attempts_in_flight,
                reachable=self.unreachable_since is None,
                last_error=self.last_error,
            )


def check_hedge_endpoints(hedge_endpoints: object, hedging_on: bool) -> tuple[str, ...]:
    """Validate the ``hedge_endpoints`` argument; return it as a tuple of strings.

    Raises ``TypeError`` for a lone string or a non-string item, and ``ValueError`` for an empty name,
    a name listed twice, or hedge endpoints without hedging settings.
    """
    if hedge_endpoints is None:
        return ()
    if isinstance(hedge_endpoints, (str, bytes)) or not isinstance(hedge_endpoints, Sequence):
        raise TypeError(
            "hedge_endpoints must be a list of endpoints such as ['europe-west1-pubsub.googleapis.com'], "
            f"not {type(hedge_endpoints).__name__} {hedge_endpoints!r}"
        )
    endpoints = tuple(hedge_endpoints)
    for endpoint in endpoints:
        if not isinstance(endpoint, str):
            raise TypeError(f"each hedge endpoint must be a str; got {type(endpoint).__name__} {endpoint!r}")
        if not endpoint.strip():
            raise ValueError(f"hedge_endpoints holds an empty endpoint: {list(endpoints)!r}")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"hedge_endpoints lists an endpoint twice: {list(endpoints)!r}")
    if endpoints and not hedging_on:
        raise ValueError(
            f"hedge_endpoints={list(endpoints)!r} needs hedging: pass hedging_settings=HedgingSettings(...)"
        )
    return endpoints


class EndpointRoutes:
    """The endpoints of one publisher: the primary first, then the hedge endpoints in the order given.

    Each endpoint is a :class:`~hedgepub._transport.pool.ConnectionPool`, opened on first use (on the
    publisher's loop, where gRPC channels must be made): its connections are made by its connect
    function, or given ready-made (tests pass scripted transports). Which connection of the pool an
    attempt takes is the pool's choice (:meth:`ConnectionPool.pick`).
    """

    def __init__(
        self,
        labels: Sequence[str],
        pools: Sequence[ConnectionPool],
        descriptions: Sequence[str] | None = None,
    ) -> None:
        if not labels or len(labels) != len(pools):
            raise ValueError("EndpointRoutes needs one connection pool per label, the primary first")
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"every endpoint must be a different target (hedges to the primary need no hedge "
                f"endpoint); got {list(labels)!r}"
            )
        self.labels: tuple[str, ...] = tuple(labels)
        self._pools = tuple(pools)
        self._recorders = tuple(_EndpointRecorder(description) for description in (descriptions or labels))
        for pool, recorder in zip(self._pools, self._recorders, strict=True):
            pool.description = pool.description or recorder.description
        self._all_open = False

    @property
    def hedge_endpoint_count(self) -> int:
        """How many endpoints besides the primary take hedges."""
        return len(self.labels) - 1

    def index_for(self, attempt_number: int) -> int:
        """Which endpoint attempt ``attempt_number`` goes to: 0 (primary) for the original and retries."""
        others = self.hedge_endpoint_count
        if attempt_number <= 0 or others == 0:
            return 0
        return 1 + (attempt_number - 1) % others

    @property
    def connected(self) -> bool:
        """Whether any endpoint's connections have been opened (or handed over) yet."""
        return any(pool.opened for pool in self._pools)

    def pool(self, index: int) -> ConnectionPool:
        """Endpoint ``index``'s connection pool, opened on first use.

        A hedge endpoint that cannot be opened raises a retryable ``UNAVAILABLE``
        :class:`~hedgepub.RpcError`, which ends its hedge quietly, as an unreachable endpoint's would.
        """
        pool = self._pools[index]
        if not pool.opened:
            try:
                pool.open()
            except Exception as error:
                if index == 0:
                    raise
                raise RpcError(
                    StatusCode.UNAVAILABLE, f"cannot open hedge endpoint {self.labels[index]}: {error}"
                ) from error
        return pool

    def transport(self, index: int) -> Transport:
        """The transport of endpoint ``index``'s first connection, opened on first use."""
        return self.pool(index).transport(0)

    def open_all(self) -> None:
        """Open every endpoint's connections now (once), so that no hedge waits for its connection.

        A hedge endpoint that cannot even be opened is left for :meth:`pool` to report on each of
        its hedges; only the primary's failure propagates.
        """
        if self._all_open:
            return
        self.pool(0)
        self._all_open = True
        for index in range(1, len(self.labels)):
            try:
                self.pool(index)
            except Exception:
                _LOGGER.warning("hedgepub: cannot open hedge endpoint %s", self.labels[index], exc_info=True)

    def recorder(self, index: int) -> _EndpointRecorder:
        """Endpoint ``index``'s counters."""
        return self._recorders[index]

    @property
    def ever_reached(self) -> bool:
        """Whether an attempt ever reached an endpoint (answered, or failed on a connected connection);
        while none has and the primary cannot be reached (a closed port, a wrong address), ``shutdown()``
        waits for the messages only so long (``closing.UNREACHABLE_CLOSE_TIMEOUT``)."""
        return any(recorder.ever_reached for recorder in self._recorders)

    @property
    def primary_unreachable(self) -> bool:
        """Whether the primary endpoint's latest attempts could not reach it (see ``_EndpointRecorder``)."""
        return self._recorders[0].unreachable_since is not None

    def batch_finished(self, batch: Batch, outcome: BatchOutcome | None, error: BaseException | None) -> None:
        """Count a finished batch's attempts per endpoint, and its winner's endpoint (a
        :class:`~hedgepub._publisher.observer.BatchObserver`; a batch without an outcome counts nothing).

        Counted from the engine's totals, which the rotation maps to endpoints exactly (hedges 1 to
        ``hedges_sent`` were sent), so that the endpoints add up to the publisher's ``attempts_sent``
        and ``hedges_sent`` even for a hedge cancelled before its task ever reached the transport.
        """
        if outcome is None:
            return
        attempts_sent, hedges_sent, winner_attempt = (
            outcome.attempts_sent,
            outcome.hedges_sent,
            outcome.winner_attempt,
        )
        others = self.hedge_endpoint_count
        if others == 0:
            self._recorders[0].sent(attempts_sent, hedges_sent)
        else:
            self._recorders[0].sent(attempts_sent - hedges_sent, 0)
            rounds, rest = divmod(hedges_sent, others)
            for offset in range(others):
                hedges = rounds + (1 if offset < rest else 0)
                if hedges:
                    self._recorders[1 + offset].sent(hedges, hedges)
        if winner_attempt is not None:
            self._recorders[self.index_for(winner_attempt)].won()

    def snapshot(self) -> dict[str, EndpointStats]:
        """Every endpoint's stats by label, the primary first, as a new plain dict (for a stats
        snapshot, which ``dataclasses.asdict`` copies)."""
        return {
            label: dataclasses.replace(recorder.snapshot(), connections=pool.snapshot())
            for label, recorder, pool in zip(self.labels, self._recorders, self._pools, strict=True)
        }

    async def close(self) -> None:
        """Close every connection that was opened."""
        self._all_open = False
        for pool in self._pools:
            await pool.close()

    def __repr__(self) -> str:
        return f"EndpointRoutes({list(self.labels)!r})"
