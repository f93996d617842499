"""The settings objects: defaults, the validation matrix of issue 2, value semantics, check_hedging."""

from __future__ import annotations

import dataclasses
import datetime
import math

import pytest

from hedgepub import (
    AdaptiveDelay,
    BatchSettings,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    RetrySettings,
    StatusCode,
    check_hedging,
)
from hedgepub._status import DEFAULT_RETRYABLE_CODES


def test_hedging_defaults() -> None:
    settings = HedgingSettings()
    assert (settings.hedge_delay, settings.max_tokens, settings.refill_ratio) == (1.0, 50, 0.1)


def test_retry_defaults_are_the_reference_ones() -> None:
    retry = RetrySettings()
    assert retry.initial_retry_delay == 0.1
    assert retry.retry_delay_multiplier == 4
    assert retry.max_retry_delay == 60
    assert retry.initial_rpc_timeout == 5
    assert retry.rpc_timeout_multiplier == 4
    assert retry.max_rpc_timeout == 60
    assert retry.total_timeout == 600
    assert retry.retryable_codes == {
        StatusCode.ABORTED,
        StatusCode.CANCELLED,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.INTERNAL,
        StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.UNAVAILABLE,
        StatusCode.UNKNOWN,
    }
    assert retry.retryable_codes == DEFAULT_RETRYABLE_CODES


def test_retry_schedule_helpers() -> None:
    retry = RetrySettings()
    assert [retry.retry_delay(n) for n in range(5)] == pytest.approx([0.1, 0.4, 1.6, 6.4, 25.6])
    assert retry.retry_delay(10) == 60
    assert [retry.rpc_timeout(n) for n in range(4)] == [5, 20, 60, 60]


def test_batch_and_flow_control_defaults() -> None:
    batch = BatchSettings()
    assert (batch.max_messages, batch.max_bytes, batch.max_latency) == (100, 1_000_000, 0.01)
    flow = FlowControlSettings()
    assert (flow.message_limit, flow.byte_limit) == (1000, 10_000_000)
    assert flow.limit_exceeded_behavior is LimitExceededBehavior.IGNORE
    assert {member.name for member in LimitExceededBehavior} == {"IGNORE", "BLOCK", "ERROR"}


# hedge_delay: 0.1 s to 10 s inclusive, seconds or timedelta.


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (0.1, 0.1),
        (10, 10.0),
        (10.0, 10.0),
        (datetime.timedelta(milliseconds=100), 0.1),
        (datetime.timedelta(seconds=10), 10.0),
        (datetime.timedelta(milliseconds=500), 0.5),
    ],
)
def test_hedge_delay_accepted(given: object, expected: float) -> None:
    assert HedgingSettings(hedge_delay=given).hedge_delay == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given",
    [0.099, 10.001, datetime.timedelta(milliseconds=99), datetime.timedelta(seconds=10.001), 0, -1],
)
def test_hedge_delay_out_of_range_is_refused(given: object) -> None:
    with pytest.raises(ValueError) as raised:
        HedgingSettings(hedge_delay=given)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "hedge_delay" in message and repr(given) in message
    assert "0.1 s" in message and "10 s" in message


@pytest.mark.parametrize(
    ("given", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (True, TypeError),
        (False, TypeError),
        ("1.0", TypeError),
        (None, TypeError),
    ],
)
def test_hedge_delay_bad_values_are_refused_with_the_right_type(given: object, error: type) -> None:
    with pytest.raises(error) as raised:
        HedgingSettings(hedge_delay=given)  # type: ignore[arg-type]
    assert "hedge_delay" in str(raised.value)
    assert repr(given) in str(raised.value)


# max_tokens: whole number 1 to 250.


@pytest.mark.parametrize("given", [1, 50, 250])
def test_max_tokens_accepted(given: int) -> None:
    assert HedgingSettings(max_tokens=given).max_tokens == given


@pytest.mark.parametrize("given", [0, -5, 251])
def test_max_tokens_out_of_range_is_refused(given: int) -> None:
    with pytest.raises(ValueError) as raised:
        HedgingSettings(max_tokens=given)
    message = str(raised.value)
    assert "max_tokens" in message and repr(given) in message and "[1, 250]" in message


@pytest.mark.parametrize(
    ("given", "error"), [(True, TypeError), (5.0, TypeError), ("5", TypeError), (math.nan, TypeError)]
)
def test_max_tokens_bad_types_are_refused(given: object, error: type) -> None:
    with pytest.raises(error) as raised:
        HedgingSettings(max_tokens=given)  # type: ignore[arg-type]
    assert "max_tokens" in str(raised.value) and repr(given) in str(raised.value)


# refill_ratio: 0.001 to 0.2 inclusive.


@pytest.mark.parametrize("given", [0.001, 0.05, 0.2])
def test_refill_ratio_accepted(given: float) -> None:
    assert HedgingSettings(refill_ratio=given).refill_ratio == given


@pytest.mark.parametrize("given", [0, -0.1, 0.0009, 0.21, math.nan, math.inf])
def test_refill_ratio_out_of_range_is_refused(given: float) -> None:
    with pytest.raises(ValueError) as raised:
        HedgingSettings(refill_ratio=given)
    message = str(raised.value)
    assert "refill_ratio" in message and repr(given) in message and "[0.001, 0.2]" in message


@pytest.mark.parametrize("given", [True, "0.1", None])
def test_refill_ratio_bad_types_are_refused(given: object) -> None:
    with pytest.raises(TypeError) as raised:
        HedgingSettings(refill_ratio=given)  # type: ignore[arg-type]
    assert "refill_ratio" in str(raised.value) and repr(given) in str(raised.value)


# Value semantics.


def test_settings_are_immutable() -> None:
    settings = HedgingSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.hedge_delay = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RetrySettings().total_timeout = 1.0  # type: ignore[misc]


def test_equality_and_hash_follow_the_values() -> None:
    a = HedgingSettings(hedge_delay=datetime.timedelta(milliseconds=500), max_tokens=100, refill_ratio=0.05)
    b = HedgingSettings(hedge_delay=0.5, max_tokens=100, refill_ratio=0.05)
    assert a == b and hash(a) == hash(b)
    assert a != HedgingSettings(hedge_delay=0.5, max_tokens=99, refill_ratio=0.05)
    assert len({a, b, HedgingSettings()}) == 2
    assert RetrySettings() == RetrySettings() and hash(RetrySettings()) == hash(RetrySettings())
    assert BatchSettings(max_messages=10) != BatchSettings()


def test_repr_is_readable() -> None:
    assert repr(HedgingSettings()) == "HedgingSettings(hedge_delay=1.0, max_tokens=50, refill_ratio=0.1)"
    assert "total_timeout=600.0" in repr(RetrySettings())


def test_other_settings_validate_too() -> None:
    with pytest.raises(ValueError, match="max_messages"):
        BatchSettings(max_messages=1001)
    with pytest.raises(ValueError, match="max_bytes"):
        BatchSettings(max_bytes=10_000_001)
    with pytest.raises(ValueError, match="limit_exceeded_behavior"):
        FlowControlSettings(limit_exceeded_behavior="sometimes")  # type: ignore[arg-type]
    assert FlowControlSettings(limit_exceeded_behavior="block").limit_exceeded_behavior is (  # type: ignore[arg-type]
        LimitExceededBehavior.BLOCK
    )
    with pytest.raises(ValueError, match="retryable_codes"):
        RetrySettings(retryable_codes={StatusCode.OK})
    with pytest.raises(ValueError, match="initial_rpc_timeout"):
        RetrySettings(initial_rpc_timeout=61)


# Construction errors: check_hedging.


def test_check_hedging_accepts_a_valid_combination_and_no_hedging() -> None:
    check_hedging(HedgingSettings(hedge_delay=4.999), RetrySettings(), enable_message_ordering=False)
    check_hedging(None, RetrySettings(), enable_message_ordering=True)


@pytest.mark.parametrize("delay", [5.0, 6.0])
def test_delay_not_shorter_than_initial_rpc_timeout_is_refused(delay: float) -> None:
    with pytest.raises(ValueError) as raised:
        check_hedging(HedgingSettings(hedge_delay=delay), RetrySettings(), enable_message_ordering=False)
    message = str(raised.value)
    assert f"hedge_delay ({delay:g} s)" in message and "initial_rpc_timeout (5 s)" in message


def test_delay_equal_to_total_timeout_is_refused() -> None:
    retry = RetrySettings(initial_rpc_timeout=3, total_timeout=2)
    with pytest.raises(ValueError) as raised:
        check_hedging(HedgingSettings(hedge_delay=2), retry, enable_message_ordering=False)
    assert "hedge_delay (2 s)" in str(raised.value) and "total_timeout (2 s)" in str(raised.value)


def test_hedging_with_message_ordering_is_accepted() -> None:
    # Keyed batches are never hedged (rule 23), so the two combine.
    check_hedging(HedgingSettings(), RetrySettings(), enable_message_ordering=True)
    check_hedging(HedgingSettings(), RetrySettings())


# The adaptive delay.


def test_adaptive_delay_defaults_and_value_semantics() -> None:
    adaptive = AdaptiveDelay()
    assert (adaptive.percentile, adaptive.window, adaptive.min_samples) == (95.0, 10.0, 100)
    assert AdaptiveDelay(window=datetime.timedelta(seconds=30)) == AdaptiveDelay(window=30)
    settings = HedgingSettings(adaptive_delay=AdaptiveDelay(percentile=99))
    assert settings.hedge_delay == 1.0  # still the delay used until enough latencies are seen
    assert settings == HedgingSettings(adaptive_delay=AdaptiveDelay(percentile=99.0))
    assert len({settings, HedgingSettings(), HedgingSettings(adaptive_delay=AdaptiveDelay())}) == 3
    assert repr(settings) == (
        "HedgingSettings(hedge_delay=1.0, max_tokens=50, refill_ratio=0.1, "
        "adaptive_delay=AdaptiveDelay(percentile=99.0, window=10.0, min_samples=100))"
    )


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("percentile", 49.9, ValueError),
        ("percentile", 99.95, ValueError),
        ("percentile", math.nan, ValueError),
        ("percentile", True, TypeError),
        ("percentile", "95", TypeError),
        ("window", 0.5, ValueError),
        ("window", 3601, ValueError),
        ("window", math.inf, ValueError),
        ("window", "10s", TypeError),
        ("min_samples", 0, ValueError),
        ("min_samples", 1_000_001, ValueError),
        ("min_samples", 10.0, TypeError),
        ("min_samples", False, TypeError),
    ],
)
def test_adaptive_delay_refuses_bad_values_naming_the_field(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field) as raised:
        AdaptiveDelay(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(raised.value)


def test_adaptive_delay_must_be_an_adaptive_delay() -> None:
    with pytest.raises(TypeError, match="adaptive_delay must be an AdaptiveDelay"):
        HedgingSettings(adaptive_delay="auto")  # type: ignore[arg-type]


def test_adaptive_delay_needs_room_under_half_the_rpc_timeouts() -> None:
    adaptive = HedgingSettings(hedge_delay=0.1, adaptive_delay=AdaptiveDelay())
    check_hedging(adaptive, RetrySettings(initial_rpc_timeout=0.2), enable_message_ordering=False)
    with pytest.raises(ValueError, match="adaptive_delay needs room") as raised:
        check_hedging(adaptive, RetrySettings(initial_rpc_timeout=0.15), enable_message_ordering=False)
    assert "initial_rpc_timeout (0.15 s)" in str(raised.value)
