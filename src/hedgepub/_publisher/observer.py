"""One observer for one event: a batch has finished.

A batch that went through the hedging engine ends with a :class:`~hedgepub._hedging.engine.BatchOutcome`
(its message IDs or its error, and its attempts). The publisher hands it once, to one
:class:`BatchObserver`; the stats (:class:`~hedgepub._publisher.stats.StatsRecorder`), the endpoints
(:class:`~hedgepub._publisher.routes.EndpointRoutes`) and the OpenTelemetry instrumentation
(:class:`~hedgepub._publisher.telemetry.PublisherTelemetry`) each implement it, and
:class:`BatchObservers` hands the event on to all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hedgepub._hedging.engine import BatchOutcome
    from hedgepub._publisher.batch import Batch


class BatchObserver(Protocol):
    """Told once about every batch that finished."""

    def batch_finished(self, batch: Batch, outcome: BatchOutcome | None, error: BaseException | None) -> None:
        """``batch`` finished with ``outcome``; or, with ``outcome`` ``None``, with an internal ``error``
        before the engine could give one (its messages failed)."""


class BatchObservers:
    """Several observers seen as one; each is told in turn, and one that raises does not silence the next."""

    def __init__(self, observers: Iterable[BatchObserver]) -> None:
        self._observers = tuple(observers)

    def batch_finished(self, batch: Batch, outcome: BatchOutcome | None, error: BaseException | None) -> None:
        """Tell every observer; re-raise the first error once all have been told."""
        failure: BaseException | None = None
        for observer in self._observers:
            try:
                observer.batch_finished(batch, outcome, error)
            except Exception as raised:  # the others must still count the batch
                failure = failure or raised
        if failure is not None:
            raise failure

    def __repr__(self) -> str:
        return f"BatchObservers({[type(observer).__name__ for observer in self._observers]})"
