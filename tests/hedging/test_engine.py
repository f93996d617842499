"""The hedged-attempt engine, rule by rule (docs/hedging.md "One batch, step by step"), on virtual time.

Every test asserts exact virtual instants: when each attempt was sent, with which attempt number and
timeout, when losers were cancelled and when the batch resolved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hedgepub import PublishError, PublishTimeoutError, ResponseMismatchError, RpcError, StatusCode
from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.engine import (
    BatchOutcome,
    CancelAttempt,
    CancelTimer,
    HedgingCore,
    Resolve,
    SendAttempt,
    StartTimer,
    Timer,
    TimerKind,
    run_batch,
)
from hedgepub._settings import HedgingSettings, RetrySettings
from hedgepub._status import DEFAULT_RETRYABLE_CODES
from hedgepub.testing.virtual_time import run_virtual

BucketWith = Callable[..., TokenBucket]

#: Long enough to outlast any deadline in these tests: the attempt never answers by itself.
HANG = 1e6


@dataclass(frozen=True)
class Call:
    """One attempt as the engine sent it."""

    time: float
    number: int
    timeout: float


@dataclass
class Script:
    """Attempt ``i`` (in sending order) waits ``steps[i][0]`` seconds, then returns or raises ``steps[i][1]``.

    A result of ``None`` means message IDs ``a<i>-0 .. a<i>-<message_count-1>``. Calls past the end
    of ``steps`` use ``default``.
    """

    steps: list[tuple[float, object]]
    default: tuple[float, object] = (HANG, None)
    message_count: int = 1
    calls: list[Call] = field(default_factory=list)
    cancelled: list[tuple[int, float]] = field(default_factory=list)

    async def __call__(self, number: int, timeout: float) -> Sequence[str]:
        index = len(self.calls)
        loop = asyncio.get_running_loop()
        self.calls.append(Call(loop.time(), number, timeout))
        delay, result = self.steps[index] if index < len(self.steps) else self.default
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append((index, loop.time()))
            raise
        if isinstance(result, BaseException):
            raise result
        if result is None:
            return [f"a{index}-{m}" for m in range(self.message_count)]
        return result  # type: ignore[return-value]

    @property
    def times(self) -> list[float]:
        return [call.time for call in self.calls]

    @property
    def numbers(self) -> list[int]:
        return [call.number for call in self.calls]

    @property
    def timeouts(self) -> list[float]:
        return [call.timeout for call in self.calls]


def run_script(
    script: Script,
    *,
    retry: RetrySettings | None = None,
    hedging: HedgingSettings | None = None,
    bucket: TokenBucket | None = None,
) -> tuple[BatchOutcome, float]:
    """Run one batch on virtual time; return its outcome and the virtual time ``run_batch`` returned at."""

    async def scenario() -> tuple[BatchOutcome, float]:
        outcome = await run_batch(
            script,
            message_count=script.message_count,
            retry=retry or RetrySettings(),
            hedging=hedging,
            bucket=bucket,
        )
        return outcome, asyncio.get_running_loop().time()

    return run_virtual(scenario())


def exactly(value: object) -> object:
    """Virtual times are exact up to float rounding of sums like 0.1 + 0.4."""
    return pytest.approx(value, abs=1e-9)


UNAVAILABLE = RpcError(StatusCode.UNAVAILABLE, "try again")
HEDGING = HedgingSettings(hedge_delay=1.0)


# Rule 1: the original, retried with exponential back-off and growing timeouts inside the deadline.


def test_original_success_resolves_with_its_ids_and_the_first_timeout() -> None:
    script = Script([(0.25, ["x", "y"])], message_count=2)
    outcome, returned_at = run_script(script)
    assert outcome.ok
    assert outcome.message_ids == ("x", "y")
    assert outcome.winner_attempt == 0
    assert not outcome.hedge_won
    assert (outcome.attempts_sent, outcome.hedges_sent, outcome.hedges_skipped) == (1, 0, 0)
    assert outcome.latency == exactly(0.25)
    assert returned_at == exactly(0.25)
    assert script.calls == [Call(0.0, 0, 5.0)]


def test_retries_wait_exactly_the_exponential_delays_with_growing_timeouts() -> None:
    script = Script([(0, UNAVAILABLE)] * 4 + [(0, None)])
    outcome, _ = run_script(script)
    assert outcome.ok and outcome.winner_attempt == 0
    assert outcome.attempts_sent == 5
    # Back-off 0.1, 0.4, 1.6, 6.4 s (initial 0.1, multiplier 4, no jitter).
    assert script.times == exactly([0.0, 0.1, 0.5, 2.1, 8.5])
    # rpc_timeout(n) = 5 * 4**n capped at 60.
    assert script.timeouts == exactly([5.0, 20.0, 60.0, 60.0, 60.0])
    assert script.numbers == [0, 0, 0, 0, 0]


def test_retry_delays_are_capped_by_max_retry_delay() -> None:
    retry = RetrySettings(initial_retry_delay=1, retry_delay_multiplier=3, max_retry_delay=5)
    script = Script([(0, UNAVAILABLE)] * 4 + [(0, None)])
    run_script(script, retry=retry)
    gaps = [later - earlier for earlier, later in zip(script.times, script.times[1:], strict=False)]
    assert gaps == exactly([1.0, 3.0, 5.0, 5.0])


def test_engine_enforces_each_attempt_timeout_and_retries_after_it() -> None:
    # The attempt ignores its timeout; the engine cancels it at 5 s and retries 0.1 s later.
    script = Script([(HANG, None), (0.5, None)])
    outcome, _ = run_script(script)
    assert outcome.ok and outcome.attempts_sent == 2
    assert script.cancelled == [(0, exactly(5.0))]
    assert script.calls == [Call(0.0, 0, 5.0), Call(exactly(5.1), 0, 20.0)]
    assert outcome.latency == exactly(5.6)


def test_attempt_timeouts_are_cut_to_the_time_left_before_the_deadline() -> None:
    retry = RetrySettings(total_timeout=12)
    script = Script([])  # every attempt hangs
    outcome, _ = run_script(script, retry=retry)
    # 5 s, then 0.1 s back-off, then min(20, 12 - 5.1) = 6.9 s, ending exactly at the deadline.
    assert script.times == exactly([0.0, 5.1])
    assert script.timeouts == exactly([5.0, 6.9])
    assert isinstance(outcome.error, PublishTimeoutError)
    assert outcome.latency == exactly(12.0)


@pytest.mark.parametrize("code", sorted(DEFAULT_RETRYABLE_CODES))
def test_every_default_retryable_code_is_retried(code: StatusCode) -> None:
    script = Script([(0, RpcError(code, "transient")), (0, None)])
    outcome, _ = run_script(script)
    assert outcome.ok and outcome.attempts_sent == 2
    assert script.times == exactly([0.0, 0.1])


def test_a_code_left_out_of_retryable_codes_is_not_retried() -> None:
    retry = RetrySettings(retryable_codes={StatusCode.ABORTED})
    script = Script([(0, UNAVAILABLE), (0, None)])
    outcome, _ = run_script(script, retry=retry)
    assert outcome.error is UNAVAILABLE
    assert outcome.attempts_sent == 1


# Rule 2: hedge k at t0 + k * hedge_delay, paid with one token, running min(time left, 10 s); no token
# stops hedging for the batch.


def test_hedge_is_sent_at_exactly_t0_plus_delay_with_a_ten_second_timeout(bucket_with: BucketWith) -> None:
    bucket = bucket_with(1)
    script = Script([(HANG, None), (0.5, None)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket)
    assert script.calls == [Call(0.0, 0, 5.0), Call(1.0, 1, 10.0)]
    assert outcome.hedges_sent == 1
    assert bucket.tokens == pytest.approx(0.1)  # 1 spent, 0.1 back for the success


def test_hedge_delay_comes_from_settings(bucket_with: BucketWith) -> None:
    script = Script([(HANG, None), (0.1, None)])
    outcome, _ = run_script(script, hedging=HedgingSettings(hedge_delay=0.3), bucket=bucket_with(1))
    assert script.times == exactly([0.0, 0.3])
    assert outcome.latency == exactly(0.4)


def test_hedges_repeat_every_delay_until_tokens_run_out_then_stop(bucket_with: BucketWith) -> None:
    bucket = bucket_with(3)
    script = Script([])  # all hang

    async def scenario() -> BatchOutcome:
        async def refill_later() -> None:
            # Tokens arriving after the skip at 4.0 must not restart hedging for this batch.
            await asyncio.sleep(4.5)
            for _ in range(20):
                bucket.refill()

        refiller = asyncio.ensure_future(refill_later())
        outcome = await run_batch(
            script, message_count=1, retry=RetrySettings(total_timeout=8), hedging=HEDGING, bucket=bucket
        )
        await refiller
        return outcome

    outcome = run_virtual(scenario())
    assert script.numbers[:4] == [0, 1, 2, 3]
    assert script.times[:4] == exactly([0.0, 1.0, 2.0, 3.0])
    assert all(call.number == 0 for call in script.calls[4:])  # only retries of the original after that
    assert (outcome.hedges_sent, outcome.hedges_skipped) == (3, 1)
    assert bucket.tokens == pytest.approx(2.0)


def test_no_token_means_no_hedge_and_one_skip(bucket_with: BucketWith) -> None:
    bucket = bucket_with(0.9)
    script = Script([(2.5, None)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket)
    assert script.numbers == [0]
    assert (outcome.hedges_sent, outcome.hedges_skipped) == (0, 1)
    assert bucket.tokens == pytest.approx(1.0)


def test_without_hedging_settings_nothing_is_hedged(bucket_with: BucketWith) -> None:
    bucket = bucket_with(5)
    script = Script([(3.5, None)])
    outcome, _ = run_script(script, bucket=bucket)
    assert script.numbers == [0]
    assert (outcome.hedges_sent, outcome.hedges_skipped) == (0, 0)
    assert bucket.tokens == pytest.approx(5.1)


def test_hedge_timeout_is_cut_to_the_time_left(bucket_with: BucketWith) -> None:
    script = Script([])
    outcome, _ = run_script(
        script, retry=RetrySettings(total_timeout=2.5), hedging=HEDGING, bucket=bucket_with(5)
    )
    assert script.calls == [Call(0.0, 0, 2.5), Call(1.0, 1, 1.5), Call(2.0, 2, 0.5)]
    assert outcome.latency == exactly(2.5)


def test_no_hedge_point_at_or_after_the_deadline(bucket_with: BucketWith) -> None:
    bucket = bucket_with(5)
    script = Script([])
    outcome, _ = run_script(script, retry=RetrySettings(total_timeout=3), hedging=HEDGING, bucket=bucket)
    assert script.numbers == [0, 1, 2]
    assert outcome.hedges_sent == 2
    assert bucket.tokens == pytest.approx(3.0)


def test_a_hedge_gets_the_time_left_capped_at_ten_seconds_whatever_the_originals_timeout(
    bucket_with: BucketWith,
) -> None:
    # The original's tries get 5 s, then 20 s; every hedge gets min(time left, 10 s), never those.
    retry = RetrySettings(
        initial_rpc_timeout=5, max_rpc_timeout=60, rpc_timeout_multiplier=4, total_timeout=13.5
    )
    script = Script([(0, UNAVAILABLE)])  # then everything hangs
    outcome, _ = run_script(script, retry=retry, hedging=HEDGING, bucket=bucket_with(20))
    hedges = [call for call in script.calls if call.number > 0]
    assert script.calls[:2] == [Call(0.0, 0, 5.0), Call(0.1, 0, 13.4)]  # the retry: min(20 s, time left)
    assert [call.time for call in hedges[:5]] == exactly([1.0, 2.0, 3.0, 4.0, 5.0])
    assert [call.timeout for call in hedges] == exactly([min(10.0, 13.5 - k) for k in range(1, 14)])
    assert isinstance(outcome.error, PublishTimeoutError)


# Rule 3: the first success wins at once; losers are cancelled; no more hedges; one refill.


def test_hedge_wins_losers_are_cancelled_and_the_bucket_refilled_once(bucket_with: BucketWith) -> None:
    bucket = bucket_with(2)
    script = Script([(HANG, None), (0.2, None)], message_count=3)
    outcome, returned_at = run_script(script, hedging=HEDGING, bucket=bucket)
    assert outcome.ok and outcome.hedge_won
    assert outcome.winner_attempt == 1
    assert outcome.message_ids == ("a1-0", "a1-1", "a1-2")  # the hedge's IDs, not the original's
    assert outcome.latency == exactly(1.2)
    assert returned_at == exactly(1.2)
    assert script.cancelled == [(0, exactly(1.2))]
    assert len(script.calls) == 2  # no hedge at 2.0
    assert bucket.tokens == pytest.approx(1.1)


def test_original_wins_and_the_running_hedge_is_cancelled(bucket_with: BucketWith) -> None:
    script = Script([(1.5, None), (HANG, None)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.winner_attempt == 0 and not outcome.hedge_won
    assert outcome.message_ids == ("a0-0",)
    assert script.cancelled == [(1, exactly(1.5))]
    assert (outcome.attempts_sent, outcome.hedges_sent) == (2, 1)


def test_result_is_not_held_back_by_a_loser_slow_to_stop(bucket_with: BucketWith) -> None:
    stopped: list[float] = []

    async def attempt(number: int, timeout: float) -> Sequence[str]:
        loop = asyncio.get_running_loop()
        if number == 1:
            await asyncio.sleep(0.2)
            return ["hedge"]
        try:
            await asyncio.sleep(HANG)
        except asyncio.CancelledError:
            await asyncio.sleep(30)  # takes its time to wind down
            stopped.append(loop.time())
            raise
        return ["original"]

    async def scenario() -> tuple[BatchOutcome, float]:
        outcome = await run_batch(
            attempt, message_count=1, retry=RetrySettings(), hedging=HEDGING, bucket=bucket_with(1)
        )
        returned_at = asyncio.get_running_loop().time()
        await asyncio.sleep(40)
        return outcome, returned_at

    outcome, returned_at = run_virtual(scenario())
    assert outcome.message_ids == ("hedge",)
    assert returned_at == exactly(1.2)
    assert stopped == [exactly(31.2)]


def test_success_without_hedging_refills_once(bucket_with: BucketWith) -> None:
    bucket = bucket_with(0)
    run_script(Script([(0.01, None)]), hedging=HEDGING, bucket=bucket)
    assert bucket.tokens == pytest.approx(0.1)


# Rule 4: an error never fails the batch while another attempt may still succeed; when none is left, the
# batch fails with the original's error.


@pytest.mark.parametrize(
    "code", [StatusCode.NOT_FOUND, StatusCode.PERMISSION_DENIED, StatusCode.INVALID_ARGUMENT]
)
def test_non_retryable_status_from_the_original_fails_at_once(code: StatusCode) -> None:
    error = RpcError(code, "no")
    script = Script([(0.3, error)])
    outcome, _ = run_script(script)
    assert not outcome.ok
    assert outcome.error is error
    assert outcome.message_ids is None and outcome.winner_attempt is None
    assert outcome.attempts_sent == 1
    assert outcome.latency == exactly(0.3)


def test_a_hedge_refused_with_permission_denied_while_the_original_then_succeeds_publishes(
    bucket_with: BucketWith,
) -> None:
    bucket = bucket_with(1)
    refused = RpcError(StatusCode.PERMISSION_DENIED, "not in this region")
    script = Script([(2.0, None), (0.4, refused)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket)
    assert outcome.ok and outcome.winner_attempt == 0
    assert outcome.message_ids == ("a0-0",)
    assert script.times == exactly([0.0, 1.0])  # no token left for hedge 2 at 2.0
    assert outcome.latency == exactly(2.0)
    assert script.cancelled == []
    assert bucket.tokens == pytest.approx(0.1)  # the token was spent; the original's success refilled


def test_the_original_failing_for_good_waits_for_the_running_hedge_which_wins(
    bucket_with: BucketWith,
) -> None:
    refused = RpcError(StatusCode.PERMISSION_DENIED, "primary refuses")
    script = Script([(1.5, refused), (2.0, None)])
    outcome, returned_at = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.ok and outcome.winner_attempt == 1
    assert outcome.message_ids == ("a1-0",)
    assert returned_at == exactly(3.0) and outcome.latency == exactly(3.0)
    assert script.cancelled == []  # the hedge was waited for, not cancelled


def test_all_attempts_failing_fails_the_batch_with_the_originals_error(bucket_with: BucketWith) -> None:
    original_error = RpcError(StatusCode.PERMISSION_DENIED, "primary refuses")
    hedge_error = RpcError(StatusCode.NOT_FOUND, "no such topic there")
    script = Script([(1.5, original_error), (1.0, hedge_error)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.error is original_error
    assert outcome.latency == exactly(2.0)  # when the hedge, the last attempt, failed
    assert outcome.attempts_sent == 2


def test_a_hedge_failing_first_leaves_the_original_to_fail_with_its_own_error(
    bucket_with: BucketWith,
) -> None:
    original_error = RpcError(StatusCode.INVALID_ARGUMENT, "bad")
    script = Script([(1.5, original_error), (0.1, RpcError(StatusCode.NOT_FOUND, "hedge"))])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.error is original_error
    assert outcome.latency == exactly(1.5)


def test_a_hedge_error_while_the_original_backs_off_waits_for_the_retry(bucket_with: BucketWith) -> None:
    # Nothing runs between the hedge's error at 1.2 and the retry at 1.6, yet the batch is not over.
    retry = RetrySettings(initial_retry_delay=0.1)
    script = Script([(1.5, UNAVAILABLE), (0.2, RpcError(StatusCode.PERMISSION_DENIED, "no")), (0.3, None)])
    outcome, _ = run_script(script, retry=retry, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.ok and outcome.winner_attempt == 0
    assert script.times == exactly([0.0, 1.0, 1.6])
    assert outcome.latency == exactly(1.9)


def test_an_original_failed_for_good_keeps_its_error_at_the_deadline(bucket_with: BucketWith) -> None:
    refused = RpcError(StatusCode.PERMISSION_DENIED, "primary refuses")
    script = Script([(1.5, refused)])  # the hedge hangs past the deadline
    outcome, _ = run_script(
        script, retry=RetrySettings(total_timeout=4), hedging=HEDGING, bucket=bucket_with(1)
    )
    assert outcome.error is refused
    assert outcome.latency == exactly(4.0)
    assert script.cancelled == [(1, exactly(4.0))]


def test_other_exception_is_permanent_and_kept_as_cause() -> None:
    boom = ValueError("bad payload")
    script = Script([(0.1, boom)])
    outcome, _ = run_script(script)
    assert type(outcome.error) is PublishError
    assert outcome.error.__cause__ is boom
    assert "ValueError" in str(outcome.error) and "bad payload" in str(outcome.error)
    assert outcome.attempts_sent == 1


def test_a_publish_error_subclass_passes_through_unretried() -> None:
    error = ResponseMismatchError("from the transport")
    outcome, _ = run_script(Script([(0, error), (0, None)]))
    assert outcome.error is error and outcome.attempts_sent == 1


# Rule 5: retryable status ends a hedge quietly, retries the original; running hedges keep their chance.


def test_retryable_status_ends_a_hedge_quietly(bucket_with: BucketWith) -> None:
    script = Script([(3.0, None), (0.1, UNAVAILABLE)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert outcome.ok and outcome.winner_attempt == 0
    assert script.numbers == [0, 1]  # hedge 1 not retried; no token for hedge 2
    assert (outcome.attempts_sent, outcome.hedges_sent, outcome.hedges_skipped) == (2, 1, 1)
    assert outcome.latency == exactly(3.0)


def test_original_is_retried_while_the_hedge_keeps_running_and_can_win(bucket_with: BucketWith) -> None:
    script = Script([(1.5, UNAVAILABLE), (0.8, None), (HANG, None)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(1))
    assert script.calls == [Call(0.0, 0, 5.0), Call(1.0, 1, 10.0), Call(1.6, 0, 20.0)]
    assert outcome.winner_attempt == 1
    assert outcome.latency == exactly(1.8)
    assert script.cancelled == [(2, exactly(1.8))]


RETRY_NO_ROOM = RetrySettings(
    initial_retry_delay=5, max_retry_delay=5, initial_rpc_timeout=9, max_rpc_timeout=9, total_timeout=10
)


def test_when_a_retry_would_pass_the_deadline_running_hedges_can_still_win(bucket_with: BucketWith) -> None:
    # The original fails at 6.0; a retry would start at 11.0, after the deadline at 10.0.
    script = Script([(6.0, UNAVAILABLE), (7.0, None)])
    outcome, _ = run_script(script, retry=RETRY_NO_ROOM, hedging=HEDGING, bucket=bucket_with(1))
    assert script.numbers == [0, 1]
    assert outcome.winner_attempt == 1
    assert outcome.latency == exactly(8.0)


def test_when_a_retry_would_pass_the_deadline_running_hedges_get_until_the_deadline(
    bucket_with: BucketWith,
) -> None:
    script = Script([(6.0, UNAVAILABLE)])  # the hedge hangs
    outcome, _ = run_script(script, retry=RETRY_NO_ROOM, hedging=HEDGING, bucket=bucket_with(1))
    assert isinstance(outcome.error, PublishTimeoutError)
    assert outcome.latency == exactly(10.0)
    assert script.cancelled == [(1, exactly(10.0))]


def test_with_no_retry_possible_and_nothing_running_the_batch_fails_at_once() -> None:
    script = Script([(0, UNAVAILABLE)] * 5)
    outcome, _ = run_script(script, retry=RETRY_NO_ROOM)
    assert script.times == exactly([0.0, 5.0])
    assert isinstance(outcome.error, PublishTimeoutError)
    assert outcome.error.last_error is UNAVAILABLE
    assert outcome.latency == exactly(5.0)


# Rule 6: the deadline fails the batch with a timeout error carrying the original's last error.


def test_deadline_fails_with_timeout_error_carrying_the_last_error() -> None:
    script = Script([(0, UNAVAILABLE), (0, RpcError(StatusCode.ABORTED, "second"))])  # then hangs
    outcome, _ = run_script(script, retry=RetrySettings(total_timeout=3))
    error = outcome.error
    assert isinstance(error, PublishTimeoutError)
    assert error.code is StatusCode.DEADLINE_EXCEEDED
    assert isinstance(error.last_error, RpcError)
    # The third try (sent at 0.5) was still running at the deadline: it is the last error.
    assert error.last_error.code is StatusCode.DEADLINE_EXCEEDED
    assert error.__cause__ is error.last_error
    assert "total_timeout=3 s" in str(error)
    assert outcome.latency == exactly(3.0)
    assert script.cancelled == [(2, exactly(3.0))]


def test_timeout_error_carries_the_last_status_seen() -> None:
    retry = RetrySettings(initial_retry_delay=1, max_retry_delay=1, total_timeout=2.5)
    script = Script([(0, UNAVAILABLE), (0, RpcError(StatusCode.ABORTED, "second")), (0, UNAVAILABLE)])
    outcome, _ = run_script(script, retry=retry)
    assert isinstance(outcome.error, PublishTimeoutError)
    assert outcome.error.last_error is UNAVAILABLE
    assert script.times == exactly([0.0, 1.0, 2.0])
    assert outcome.latency == exactly(2.0)


# Rule 7: a response with the wrong number of IDs is that attempt's error and refills nothing.


def test_id_count_mismatch_fails_the_batch_without_refill(bucket_with: BucketWith) -> None:
    bucket = bucket_with(0)
    script = Script([(0.1, ["only-one"])], message_count=2)
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket)
    assert isinstance(outcome.error, ResponseMismatchError)
    assert "1 message IDs for 2 messages" in str(outcome.error)
    assert outcome.message_ids is None
    assert outcome.latency == exactly(0.1)
    assert outcome.attempts_sent == 1  # not retried
    assert bucket.tokens == 0


def test_a_hedge_with_the_wrong_id_count_is_a_hedge_error_and_the_original_can_still_win(
    bucket_with: BucketWith,
) -> None:
    bucket = bucket_with(1)
    script = Script([(1.5, None), (0.1, ["only-one"])], message_count=2)
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket)
    assert outcome.ok and outcome.message_ids == ("a0-0", "a0-1")
    assert bucket.tokens == pytest.approx(0.1)  # the mismatch refilled nothing; the success did


# Rule 8: each attempt is told its number (0 = original and retries, k = hedge k) for its metadata.


def test_attempt_numbers_are_zero_for_the_original_and_k_for_hedge_k(bucket_with: BucketWith) -> None:
    script = Script([(1.5, UNAVAILABLE), (HANG, None), (HANG, None), (HANG, None), (0.5, None)])
    outcome, _ = run_script(script, hedging=HEDGING, bucket=bucket_with(3))
    assert script.numbers == [0, 1, 0, 2, 3]
    assert script.times == exactly([0.0, 1.0, 1.6, 2.0, 3.0])
    assert outcome.winner_attempt == 3
    assert outcome.attempts_sent == 5 and outcome.hedges_sent == 3


# Cancellation, external cancellation of an attempt, argument checks.


def test_cancelling_run_batch_cancels_every_attempt_and_propagates(bucket_with: BucketWith) -> None:
    script = Script([])

    async def scenario() -> tuple[bool, float]:
        task = asyncio.ensure_future(
            run_batch(script, message_count=1, retry=RetrySettings(), hedging=HEDGING, bucket=bucket_with(5))
        )
        await asyncio.sleep(2.5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled = True
        else:
            cancelled = False
        await asyncio.sleep(100)  # nothing of the batch may run on
        return cancelled, asyncio.get_running_loop().time()

    cancelled, _ = run_virtual(scenario())
    assert cancelled
    assert script.numbers == [0, 1, 2]
    assert sorted(script.cancelled) == [(0, exactly(2.5)), (1, exactly(2.5)), (2, exactly(2.5))]


def test_an_attempt_cancelled_from_outside_counts_as_cancelled_and_is_retried() -> None:
    async def attempt(number: int, timeout: float) -> Sequence[str]:
        attempt.calls += 1  # type: ignore[attr-defined]
        if attempt.calls == 1:  # type: ignore[attr-defined]
            raise asyncio.CancelledError
        return ["ok"]

    attempt.calls = 0  # type: ignore[attr-defined]
    outcome = run_virtual(run_batch(attempt, message_count=1, retry=RetrySettings()))
    assert outcome.ok and outcome.attempts_sent == 2
    assert outcome.latency == exactly(0.1)


def test_hedging_without_a_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="TokenBucket"):
        run_virtual(run_batch(Script([]), message_count=1, retry=RetrySettings(), hedging=HEDGING))


def test_message_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="message_count"):
        run_virtual(run_batch(Script([]), message_count=0, retry=RetrySettings()))


# The pure core, driven by hand: no loop, no clock.


def test_core_start_sends_the_original_and_sets_the_timers(bucket_with: BucketWith) -> None:
    core = HedgingCore(2, RetrySettings(), HEDGING, bucket_with(1))
    assert core.start(100.0) == [
        StartTimer(Timer(TimerKind.DEADLINE), 600.0),
        SendAttempt(0, 0, 5.0),
        StartTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, 0), 5.0),
        StartTimer(Timer(TimerKind.HEDGE, 1), 1.0),
    ]


def test_core_hedge_then_win_then_ignores_late_events(bucket_with: BucketWith) -> None:
    bucket = bucket_with(1)
    core = HedgingCore(1, RetrySettings(), HEDGING, bucket)
    core.start(0.0)
    assert core.timer_fired(Timer(TimerKind.HEDGE, 1), 1.0) == [
        SendAttempt(1, 1, 10.0),
        StartTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, 1), 10.0),
        StartTimer(Timer(TimerKind.HEDGE, 2), 1.0),
    ]
    actions = core.attempt_succeeded(1, ["id"], 1.25)
    assert actions[0] == CancelAttempt(0)
    assert isinstance(actions[1], Resolve)
    assert actions[1].outcome == BatchOutcome(("id",), None, 1, 2, 1, 0, 1.25, hedge_delay=1.0)
    assert core.attempt_succeeded(0, ["late"], 1.3) == []
    assert core.timer_fired(Timer(TimerKind.HEDGE, 2), 2.0) == []
    assert bucket.tokens == pytest.approx(0.1)
    assert "resolved" in repr(core)


def test_core_retry_after_retryable_failure() -> None:
    core = HedgingCore(1, RetrySettings())
    core.start(0.0)
    assert core.attempt_failed(0, UNAVAILABLE, 0.2) == [
        CancelTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, 0)),
        StartTimer(Timer(TimerKind.RETRY, 1), 0.1),
    ]
    assert core.timer_fired(Timer(TimerKind.RETRY, 1), 0.3) == [
        SendAttempt(1, 0, 20.0),
        StartTimer(Timer(TimerKind.ATTEMPT_TIMEOUT, 1), 20.0),
    ]
    assert core.last_error is UNAVAILABLE


def test_core_attempt_timeout_cancels_and_retries() -> None:
    core = HedgingCore(1, RetrySettings())
    core.start(0.0)
    actions = core.timer_fired(Timer(TimerKind.ATTEMPT_TIMEOUT, 0), 5.0)
    assert actions[0] == CancelAttempt(0)
    assert actions[-1] == StartTimer(Timer(TimerKind.RETRY, 1), 0.1)
    assert isinstance(core.last_error, RpcError)
    assert core.last_error.code is StatusCode.DEADLINE_EXCEEDED


# Properties: hedges never exceed the tokens ever added, even across many concurrent batches.

batch_plans = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=5, allow_nan=False),  # when the batch starts
        st.lists(  # each attempt: latency and whether it fails (UNAVAILABLE)
            st.tuples(st.sampled_from([0.01, 0.3, 1.5, 4.0, 30.0]), st.booleans()), min_size=1, max_size=6
        ),
    ),
    min_size=1,
    max_size=15,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans=batch_plans, ratio=st.sampled_from([0.001, 0.05, 0.2]), max_tokens=st.integers(1, 3))
def test_hedges_never_exceed_tokens_ever_added_across_concurrent_batches(
    plans: list[tuple[float, list[tuple[float, bool]]]], ratio: float, max_tokens: int
) -> None:
    bucket = TokenBucket(max_tokens, ratio)
    # Seed the bucket with a few successes so hedging actually happens.
    seeded = 10
    for _ in range(seeded):
        bucket.refill()
    retry = RetrySettings(total_timeout=20)
    hedging = HedgingSettings(hedge_delay=0.2)

    async def one_batch(start: float, steps: list[tuple[float, bool]]) -> BatchOutcome:
        await asyncio.sleep(start)
        script = Script([(latency, UNAVAILABLE if fails else None) for latency, fails in steps])
        return await run_batch(script, message_count=1, retry=retry, hedging=hedging, bucket=bucket)

    async def scenario() -> list[BatchOutcome]:
        return list(await asyncio.gather(*(one_batch(start, steps) for start, steps in plans)))

    outcomes = run_virtual(scenario())
    successes = sum(outcome.ok for outcome in outcomes)
    hedges = sum(outcome.hedges_sent for outcome in outcomes)
    assert hedges <= (seeded + successes) * ratio + 1e-9
    assert 0 <= bucket.tokens <= max_tokens
    for outcome in outcomes:
        assert outcome.attempts_sent >= 1 + outcome.hedges_sent
        assert outcome.hedges_skipped in (0, 1)
        assert outcome.ok == (outcome.error is None) == (outcome.message_ids is not None)
        assert outcome.latency <= retry.total_timeout + 1e-9
