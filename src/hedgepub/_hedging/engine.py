"""The hedged-attempt engine: one batch, from its first attempt to its outcome.

It is built in two parts, as tenacity builds its retry loop:

* :class:`HedgingCore`, a pure decision core. It does no I/O, reads no clock and starts no task: each
  event (:meth:`~HedgingCore.start`, :meth:`~HedgingCore.attempt_succeeded`,
  :meth:`~HedgingCore.attempt_failed`, :meth:`~HedgingCore.timer_fired`) comes in with the time it
  happened, and a list of actions comes out: :class:`SendAttempt`, :class:`StartTimer`,
  :class:`CancelTimer`, :class:`CancelAttempt` and, once, :class:`Resolve`. The only shared objects it
  touches are the (thread-safe, in-memory) token bucket and, with an adaptive delay, the delay source
  (:mod:`.delay`), which it asks for the batch's hedge delay at the start and tells the batch's
  latency on success, passing the event's time along.
* :func:`run_batch`, a thin asyncio driver that carries the actions out with a
  :class:`~hedgepub._clock.Clock` and turns finished attempt tasks and fired timers back into events.

The rules are those of docs/hedging.md ("One batch, step by step"), numbered the same way in the code.
Rule 8 (the metadata that ties every attempt to its batch) is the sender's job: the engine passes each
attempt its ``attempt_number`` (0 for the original and its retries, k for hedge k), and the sender puts
it, with the batch id, the batch's start time and the topic, into the request metadata.

Choices made where the rules are silent:

* Retries have no jitter, so that tests can assert the exact delays: retry ``r`` (0 for the first)
  waits ``retry.retry_delay(r)`` and then runs with ``min(retry.rpc_timeout(r + 1), time left)``.
* Every attempt's timeout is enforced by the engine too: when it passes, the attempt is cancelled and
  counts as ``DEADLINE_EXCEEDED`` (retryable by default).
* When the original fails and its next retry would start at or after the deadline, it gives up. Hedges
  still running keep their chance until the deadline (hedge points before the deadline still send new
  hedges if tokens allow). As soon as the original has given up and no attempt is running, the batch
  fails with :class:`~hedgepub.PublishTimeoutError` right away rather than idling until the deadline.
* An attempt that raises something other than :class:`~hedgepub.RpcError` ends that attempt for good, as a
  non-retryable status does: a :class:`~hedgepub.PublishError` as it is; any other exception wrapped in a
  plain ``PublishError`` (``code`` ``None``) whose ``__cause__`` is the original exception. An attempt
  task cancelled by someone other than the engine counts as ``CANCELLED`` (retryable by default).
* When the deadline passes while attempts are running, the timeout error's ``last_error`` is a
  ``DEADLINE_EXCEEDED`` :class:`~hedgepub.RpcError` for the original's try that was cut off (or, if the
  original had no error and no try running, for the hedge cut off).
* Without ``hedging`` (or with it but without a ``bucket``, which :func:`run_batch` refuses) there are
  no hedges. A ``bucket`` is refilled on every success, hedging on or not.
* A batch keeps the hedge delay it started with: hedge k is sent at ``t0 + k * delay`` even if the delay
  source moves meanwhile. On success, the delay source gets one latency per batch: the winning attempt's,
  from its own sending to its answer (the original's try, a retry or a hedge).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hedgepub._clock import DEFAULT_CLOCK, Clock, TimerHandle
from hedgepub._exceptions import PublishError, PublishTimeoutError, ResponseMismatchError, RpcError
from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import DelaySource
from hedgepub._settings import HedgingSettings, RetrySettings
from hedgepub._status import StatusCode

#: ``attempt(attempt_number, timeout_seconds) -> message IDs``; raises :class:`~hedgepub.RpcError` for a
#: status, anything else for a permanent failure.
AttemptFn = Callable[[int, float], Awaitable[Sequence[str]]]


@dataclass(frozen=True)
class BatchOutcome:
    """What happened to one batch: its message IDs or its error, and how many attempts it took."""

    #: The message IDs of the winning attempt, on success.
    message_ids: tuple[str, ...] | None
    #: Why the batch failed, on failure.
    error: PublishError | None
    #: ``0`` when the original (or one of its retries) won, ``k`` when hedge ``k`` won.
    winner_attempt: int | None
    #: Every RPC sent: the original, its retries and the hedges.
    attempts_sent: int
    hedges_sent: int
    #: Hedge points where no token was available (0 or 1: hedging stops for the batch at the first).
    hedges_skipped: int
    #: Seconds from the first attempt to the resolution.
    latency: float
    #: The hedge delay the batch used (seconds); ``None`` without hedging.
    hedge_delay: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the batch was published."""
        return self.error is None

    @property
    def hedge_won(self) -> bool:
        """Whether a hedge (not the original or its retries) won."""
        return self.winner_attempt is not None and self.winner_attempt > 0


class TimerKind(enum.Enum):
    """What a timer of the core is for."""

    #: Time for hedge ``index``.
    HEDGE = "hedge"
    #: The original's back-off is over: send its next try.
    RETRY = "retry"
    #: Attempt ``index`` (an attempt id) has run out of its own timeout.
    ATTEMPT_TIMEOUT = "attempt-timeout"
    #: The batch's total timeout.
    DEADLINE = "deadline"

    # Hashed as the object it is (Enum compares by identity), in C: a Timer is a key of the driver's
    # timers, hashed on each start and cancel, and Enum's own __hash__ is a Python call.
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Timer:
    """A timer of the core: its kind and the hedge number or attempt id it belongs to."""

    kind: TimerKind
    index: int = 0


@dataclass(frozen=True)
class SendAttempt:
    """Send attempt ``attempt_id`` (unique within the batch) with this attempt number and timeout."""

    attempt_id: int
    attempt_number: int
    timeout: float


@dataclass(frozen=True)
class StartTimer:
    """Report :meth:`HedgingCore.timer_fired` for ``timer`` after ``delay`` seconds."""

    timer: Timer
    delay: float


@dataclass(frozen=True)
class CancelTimer:
    """The timer is no longer needed."""

    timer: Timer


@dataclass(frozen=True)
class CancelAttempt:
    """Cancel attempt ``attempt_id`` (best effort); the core has already forgotten it."""

    attempt_id: int


@dataclass(frozen=True)
class Resolve:
    """The batch is over; every other running attempt and timer has been cancelled already."""

    outcome: BatchOutcome


Action = SendAttempt | StartTimer | CancelTimer | CancelAttempt | Resolve


#: The longest a hedge may run: its timeout is the smaller of this and the time left to the deadline.
HEDGE_TIMEOUT_CAP = 10.0


class OriginalState(enum.Enum):
    """Where the original attempt and its retries stand."""

    #: A try of the original is in flight.
    RUNNING = "running"
    #: The last try failed with a retryable status; the next waits for its back-off timer.
    BACKING_OFF = "backing-off"
    #: No more tries: the next would start at or after the deadline.
    GAVE_UP = "gave-up"
    #: The last try failed for good: a non-retryable status, a wrong response or another error.
    FAILED = "failed"


@dataclass
class _Running:
    attempt_number: int
    sent_at: float
    timeout: float


@dataclass
class HedgingCore:
    """The decisions of one batch, with no I/O: feed it events with their time, carry out its actions.

    Args:
        message_count: how many messages the batch holds (the number of IDs a success must return).
        retry: back-off, per-attempt timeouts, total timeout and retryable codes.
        hedging: when to hedge; ``None`` for no hedging.
        bucket: the shared token bucket, spent for hedges and refilled on success.
        delay_source: where the hedge delay comes from (adaptive delay); ``None`` for
            ``hedging.hedge_delay``.
    """

    message_count: int
    retry: RetrySettings
    hedging: HedgingSettings | None = None
    bucket: TokenBucket | None = None
    delay_source: DelaySource | None = None

    #: The hedge delay of this batch, fixed at :meth:`start`.
    hedge_delay: float | None = field(default=None, init=False)

    t0: float = field(default=0.0, init=False)
    deadline: float = field(default=0.0, init=False)
    original: OriginalState = field(default=OriginalState.RUNNING, init=False)
    resolved: bool = field(default=False, init=False)
    attempts_sent: int = field(default=0, init=False)
    hedges_sent: int = field(default=0, init=False)
    hedges_skipped: int = field(default=0, init=False)
    #: The original's latest error (its retries' included): what a failed batch reports.
    last_error: PublishError | None = field(default=None, init=False)
    _original_tries: int = field(default=0, init=False)
    _running: dict[int, _Running] = field(default_factory=dict, init=False)
    _next_attempt_id: int = field(default=0, init=False)

    def __repr__(self) -> str:
        state = "resolved" if self.resolved else self.original.value
        return (
            f"HedgingCore(state={state}, attempts_sent={self.attempts_sent}, hedges_sent={self.hedges_sent}, "
            f"running={len(self._running)})"
        )

    # Events ------------------------------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """The batch begins at ``now`` (t0): send the original (rule 1) and set the first timers."""
        if self.hedging is not None and self.bucket is None:
            raise ValueError("a TokenBucket is needed when hedging is on")
        self.t0 = now
        self.deadline = now + self.retry.total_timeout
        if self.hedging is not None:
            source = self.delay_source
            self.hedge_delay = self.hedging.hedge_delay if source is None else source.delay(now)
        actions: list[Action] = [StartTimer(Timer(TimerKind.DEADLINE), self.retry.total_timeout)]
        actions += self._send_original(now)
        actions += self._schedule_hedge(1, now)
        return actions

    def attempt_succeeded(self, attempt_id: int, message_ids: Sequence[str], now: float) -> list[Action]:
        """Attempt ``attempt_id`` returned ``message_ids`` (rules 3 and 7)."""
        running = self._running.pop(attempt_id, None)
        if running is None or self.resolved:
            return []
        ids = tuple(message_ids)
        if len(ids) != self.message_count:
            error = ResponseMismatchError(
                f"attempt {running.attempt_number} returned {len(ids)} message IDs for "
                f"{self.message_count} messages"
            )
            return self._attempt_ended(attempt_id, running, error, False, now)
        if self.bucket is not None:
            self.bucket.refill()
        if self.delay_source is not None:
            self.delay_source.record(now - running.sent_at, now)
        return self._resolve(now, message_ids=ids, winner=running.attempt_number, finished=attempt_id)

    def attempt_failed(self, attempt_id: int, error: BaseException, now: float) -> list[Action]:
        """Attempt ``attempt_id`` raised ``error`` (rules 4 and 5)."""
        running = self._running.pop(attempt_id, None)
        if running is None or self.resolved:
            return []
        failure, retryable = self._classify(error)
        return self._attempt_ended(attempt_id, running, failure, retryable, now)

    def timer_fired(self, timer: Timer, now: float) -> list[Action]:
        """``timer`` went off at ``now``."""
        if self.resolved:
            return []
        if timer.kind is TimerKind.DEADLINE or now >= self.deadline:
            return self._deadline_passed(now)
        if timer.kind is TimerKind.HEDGE:
            return self._hedge_point(timer.index, now)
        if timer.kind is TimerKind.RETRY:
            if self.original is not OriginalState.BACKING_OFF:
                return []
            return self._send_original(now)
        running = self._running.get(timer.index)
        if running is None:
            return []
        # The engine's own copy of the attempt's timeout: the transport may not enforce it (or may be late).
        timeout = RpcError(
            StatusCode.DEADLINE_EXCEEDED,
            f"attempt {running.attempt_number} got no answer within its {running.timeout:g} s timeout",
        )
        return [CancelAttempt(timer.index), *self.attempt_failed(timer.index, timeout, now)]

    # Decisions ---------------------------------------------------------------------------------------

    def _classify(self, error: BaseException) -> tuple[PublishError, bool]:
        if isinstance(error, RpcError):
            return error, error.code in self.retry.retryable_codes
        if isinstance(error, PublishError):
            return error, False
        wrapped = PublishError(f"attempt raised {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped, False

    def _send(self, attempt_number: int, timeout: float, now: float) -> list[Action]:
        attempt_id = self._next_attempt_id
        self._next_attempt_id += 1
        self._running[attempt_id] = _Running(attempt_number, now, timeout)
        self.attempts_sent += 1
        return [
            SendAttempt(attempt_id, attempt_number, timeout),
            StartTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, attempt_id), timeout),
        ]

    def _attempt_ended(
        self, attempt_id: int, running: _Running, failure: PublishError, retryable: bool, now: float
    ) -> list[Action]:
        # Rule 4: a hedge's error ends that hedge and nothing else. Rule 5: the original's retryable
        # error leads to a retry; any other error ends the original for good. Either way the batch fails
        # only once no attempt is left, with the original's error.
        actions: list[Action] = [CancelTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, attempt_id))]
        if running.attempt_number == 0:
            self.last_error = failure
            if retryable:
                actions += self._after_original_failed(now)
            else:
                self.original = OriginalState.FAILED
        return actions + self._fail_if_nothing_left(now)

    def _send_original(self, now: float) -> list[Action]:
        # Rule 1: the n-th try (0 first) gets rpc_timeout(n), cut to what is left of the deadline.
        timeout = min(self.retry.rpc_timeout(self._original_tries), self.deadline - now)
        self._original_tries += 1
        self.original = OriginalState.RUNNING
        return self._send(0, timeout, now)

    def _after_original_failed(self, now: float) -> list[Action]:
        # Rule 1/5: back off, unless the retry would start at or after the deadline.
        delay = self.retry.retry_delay(self._original_tries - 1)
        if now + delay >= self.deadline:
            self.original = OriginalState.GAVE_UP
            return []
        self.original = OriginalState.BACKING_OFF
        return [StartTimer(Timer(TimerKind.RETRY, self._original_tries), delay)]

    def _schedule_hedge(self, k: int, now: float) -> list[Action]:
        # Rule 2: hedge points at t0 + k * hedge_delay, only before the deadline.
        if self.hedging is None:
            return []
        at = self.t0 + k * self.hedge_delay  # type: ignore[operator]  # set whenever hedging is
        if at >= self.deadline:
            return []
        return [StartTimer(Timer(TimerKind.HEDGE, k), at - now)]

    def _hedge_point(self, k: int, now: float) -> list[Action]:
        assert self.bucket is not None
        if not self.bucket.try_spend():
            self.hedges_skipped = 1
            return []
        self.hedges_sent += 1
        # Rule 2: a hedge gets the time left to the deadline, at most HEDGE_TIMEOUT_CAP.
        timeout = min(HEDGE_TIMEOUT_CAP, self.deadline - now)
        return self._send(k, timeout, now) + self._schedule_hedge(k + 1, now)

    def _fail_if_nothing_left(self, now: float) -> list[Action]:
        # Rule 4: while an attempt runs (or the original waits to retry), the batch may still succeed.
        if self._running:
            return []
        if self.original is OriginalState.FAILED:
            return self._resolve(now, error=self.last_error)
        if self.original is OriginalState.GAVE_UP:
            return self._resolve(
                now, error=self._timeout_error("the next retry would start after the deadline")
            )
        return []

    def _deadline_passed(self, now: float) -> list[Action]:
        # Rule 6: an original that failed for good keeps its error. Otherwise whatever is still running
        # was cut off by the deadline (the original's try first), which makes it the last error.
        if self.original is OriginalState.FAILED:
            return self._resolve(now, error=self.last_error)
        cut_off = [running for running in self._running.values() if running.attempt_number == 0]
        if not cut_off and self.last_error is None:
            cut_off = [max(self._running.items())[1]] if self._running else []
        if cut_off:
            self.last_error = RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"attempt {cut_off[0].attempt_number} was still running at the total timeout",
            )
        return self._resolve(now, error=self._timeout_error("the total timeout passed"))

    def _timeout_error(self, why: str) -> PublishTimeoutError:
        error = PublishTimeoutError(
            f"batch not published within total_timeout={self.retry.total_timeout:g} s after "
            f"{self.attempts_sent} attempts ({why})",
            self.last_error,
        )
        if self.last_error is not None:
            error.__cause__ = self.last_error
        return error

    def _resolve(
        self,
        now: float,
        *,
        message_ids: tuple[str, ...] | None = None,
        error: PublishError | None = None,
        winner: int | None = None,
        finished: int | None = None,
    ) -> list[Action]:
        # Rule 3/4: resolve at once; the losers are cancelled, not awaited.
        self.resolved = True
        actions: list[Action] = [CancelAttempt(attempt_id) for attempt_id in self._running]
        self._running.clear()
        outcome = BatchOutcome(
            message_ids=message_ids,
            error=error,
            winner_attempt=winner,
            attempts_sent=self.attempts_sent,
            hedges_sent=self.hedges_sent,
            hedges_skipped=self.hedges_skipped,
            latency=now - self.t0,
            hedge_delay=self.hedge_delay,
        )
        actions.append(Resolve(outcome))
        return actions


async def run_batch(
    attempt: AttemptFn,
    *,
    message_count: int,
    retry: RetrySettings,
    hedging: HedgingSettings | None = None,
    bucket: TokenBucket | None = None,
    clock: Clock = DEFAULT_CLOCK,
    delay_source: DelaySource | None = None,
) -> BatchOutcome:
    """Publish one batch with retries and hedges, and report how it went.

    ``attempt(attempt_number, timeout)`` performs one RPC and returns the message IDs. A failed publish
    does not raise: it is reported in ``BatchOutcome.error``. If the task running ``run_batch`` is
    cancelled, every attempt in flight is cancelled and ``CancelledError`` propagates.

    Raises:
        ValueError: ``hedging`` is given without a ``bucket``, or ``message_count`` is less than 1.
    """
    if message_count < 1:
        raise ValueError(f"message_count must be at least 1; got {message_count!r}")
    core = HedgingCore(message_count, retry, hedging, bucket, delay_source)
    return await _Driver(attempt, clock, core).run()


def _forget_result(task: asyncio.Future[Any]) -> None:
    # A cancelled loser may still finish with an error; reading it keeps asyncio from logging
    # "exception was never retrieved" for an attempt nobody waits for any more.
    if not task.cancelled():
        task.exception()


class _Driver:
    """Carries the core's actions out on asyncio, and feeds it the events that come back.

    The core's timers share one clock timer: the driver keeps when each is due and arms a single
    :meth:`Clock.call_later` for the earliest, so a batch answered in time arms one timer and cancels
    it, where a timer each (the deadline, the attempt's timeout, the hedge) armed and cancelled three.
    Cancelling a core's timer only forgets it; the clock timer, when it fires, reports every timer
    due by then, earliest first, and is armed again for the next.
    """

    def __init__(self, attempt: AttemptFn, clock: Clock, core: HedgingCore) -> None:
        self._attempt = attempt
        self._clock = clock
        self._core = core
        self._tasks: dict[int, asyncio.Task[Sequence[str]]] = {}
        #: When each of the core's running timers is due, on the clock's scale.
        self._due: dict[Timer, float] = {}
        #: The clock timer, armed for ``_armed_for``, the earliest due time when it was armed.
        self._handle: TimerHandle | None = None
        self._armed_for = math.inf
        self._firing = False
        self._outcome: asyncio.Future[BatchOutcome] = asyncio.get_running_loop().create_future()

    async def run(self) -> BatchOutcome:
        try:
            now = self._clock.now()
            self._carry_out(self._core.start(now), now)
            return await self._outcome
        finally:
            # Reached on cancellation (or on a bug in a callback): nothing of this batch may outlive it.
            self._stop_everything()

    def _stop_everything(self) -> None:
        self._due.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle, self._armed_for = None, math.inf
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()

    async def _call(self, attempt_number: int, timeout: float) -> Sequence[str]:
        return await self._attempt(attempt_number, timeout)

    def _carry_out(self, actions: list[Action], now: float) -> None:
        """Carry out the core's ``actions`` for an event at ``now`` (the time the core was given)."""
        for action in actions:
            if isinstance(action, SendAttempt):
                task = asyncio.ensure_future(self._call(action.attempt_number, action.timeout))
                self._tasks[action.attempt_id] = task
                task.add_done_callback(functools.partial(self._finished, action.attempt_id))
            elif isinstance(action, StartTimer):
                self._due[action.timer] = now + action.delay
            elif isinstance(action, CancelTimer):
                self._due.pop(action.timer, None)
            elif isinstance(action, CancelAttempt):
                running = self._tasks.pop(action.attempt_id, None)
                if running is not None:
                    running.cancel()
            else:
                self._stop_everything()
                if not self._outcome.done():
                    self._outcome.set_result(action.outcome)
        if not self._firing:
            self._arm(now)

    def _arm(self, now: float) -> None:
        """Arm the clock timer for the earliest due timer, unless it is armed for that or sooner."""
        if not self._due:
            return
        earliest = min(self._due.values())
        if earliest < self._armed_for:
            if self._handle is not None:
                self._handle.cancel()
            self._armed_for = earliest
            self._handle = self._clock.call_later(earliest - now, self._fire)

    def _fire(self) -> None:
        """The clock timer went off: report every timer due by then, earliest first, then arm again."""
        now = self._clock.now()
        # A clock may run a timer a hair before its time (asyncio within its clock's resolution): what
        # it was armed for counts as due.
        limit = max(now, self._armed_for)
        self._handle, self._armed_for = None, math.inf
        self._firing = True
        try:
            while self._due and not self._outcome.done():
                timer, due = min(self._due.items(), key=_due_time)
                if due > limit:
                    break
                del self._due[timer]
                self._carry_out(self._core.timer_fired(timer, now), now)
        finally:
            self._firing = False
        if not self._outcome.done():
            self._arm(now)

    def _finished(self, attempt_id: int, task: asyncio.Task[Sequence[str]]) -> None:
        if self._tasks.get(attempt_id) is not task:
            _forget_result(task)  # cancelled by us: the core has already moved on
            return
        del self._tasks[attempt_id]
        now = self._clock.now()
        if task.cancelled():
            error = RpcError(StatusCode.CANCELLED, "the attempt was cancelled outside the engine")
            self._carry_out(self._core.attempt_failed(attempt_id, error, now), now)
            return
        exception = task.exception()
        if exception is None:
            self._carry_out(self._core.attempt_succeeded(attempt_id, task.result(), now), now)
        else:
            self._carry_out(self._core.attempt_failed(attempt_id, exception, now), now)


def _due_time(entry: tuple[Timer, float]) -> float:
    return entry[1]
