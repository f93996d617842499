"""Immutable, validated settings objects shared by every layer.

Every field is checked when the object is built. A value of the wrong type raises ``TypeError`` and a
value out of range raises ``ValueError``; both messages name the field, the value given and what is
allowed. Durations are seconds (``int`` or ``float``) or :class:`datetime.timedelta`, and are stored as
``float`` seconds, so ``HedgingSettings(hedge_delay=timedelta(milliseconds=500))`` equals
``HedgingSettings(hedge_delay=0.5)``.
"""

from __future__ import annotations

import datetime
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hedgepub._status import DEFAULT_RETRYABLE_CODES, StatusCode

#: What a duration accepts: seconds, or a timedelta (stored as float seconds).
_Seconds = float | datetime.timedelta

# Each settings class with a duration declares, for type checkers only, the constructor that dataclass
# generates at run time, with the durations typed as given (seconds or a timedelta) rather than as
# stored (float). tests/settings/test_typed_constructors.py holds each to its fields.

#: Pub/Sub refuses a Publish request larger than this many bytes.
MAX_REQUEST_BYTES = 10_000_000
#: Pub/Sub refuses a Publish request with more than this many messages.
MAX_MESSAGES_PER_REQUEST = 1000


def _describe(value: object) -> str:
    return repr(value)


def _duration(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    """Return ``value`` as float seconds, refusing bools, NaN, infinities and non-numbers."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be seconds as an int or float, or a datetime.timedelta; "
            f"got {type(value).__name__} {_describe(value)}"
        )
    else:
        seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be a finite number of seconds; got {_describe(value)}")
    too_low = seconds <= low if low_open else seconds < low
    if too_low or seconds > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g} s, {high:g} s]; got {_describe(value)}")
    return seconds


def _number(name: str, value: object, low: float, high: float) -> float:
    """Return ``value`` as a float in ``[low, high]``, refusing bools, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int or float; got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or not low <= number <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}]; got {value!r}")
    return number


def _whole(name: str, value: object, low: int, high: int) -> int:
    """Return ``value`` as an int in ``[low, high]``, refusing bools and floats."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number (int); got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]; got {value!r}")
    return value


@dataclass(frozen=True)
class AdaptiveDelay:
    """Pick the hedge delay from the latencies the publisher sees, instead of a fixed number.

    The delay becomes the ``percentile``-th percentile of recent Publish attempt latencies, kept in a
    rotating HDR histogram of two windows of ``window`` seconds each (so the estimate covers the last one
    to two windows and forgets older traffic). It is clamped to 0.1 s at least and at most the smaller of
    10 s and half the retry settings' initial RPC timeout (so that a hedge always has time to win before
    the original's own timeout). Until ``min_samples`` latencies are in the two windows, the fixed
    ``HedgingSettings.hedge_delay`` is used.

    Attributes:
        percentile: which percentile of recent latency becomes the delay (50 to 99.9; default 95, as
            "The Tail at Scale" recommends: about one batch in twenty is hedged).
        window: seconds each of the two histogram windows covers (1 to 3600).
        min_samples: latencies needed in the two windows before the delay adapts (1 to 1,000,000).
    """

    percentile: float = 95.0
    window: float = 10.0
    min_samples: int = 100

    if TYPE_CHECKING:

        def __init__(self, percentile: float = 95.0, window: _Seconds = 10.0, min_samples: int = 100) -> None:
            pass

    def __post_init__(self) -> None:
        object.__setattr__(self, "percentile", _number("percentile", self.percentile, 50.0, 99.9))
        object.__setattr__(self, "window", _duration("window", self.window, 1, 3600))
        object.__setattr__(self, "min_samples", _whole("min_samples", self.min_samples, 1, 1_000_000))


#: The adaptive delay's lower clamp, the same as the fixed delay's lowest allowed value.
MIN_ADAPTIVE_DELAY = 0.1
#: The adaptive delay's upper clamp, the same as the fixed delay's highest allowed value.
MAX_ADAPTIVE_DELAY = 10.0


@dataclass(frozen=True)
class HedgingSettings:
    """When to send a hedged copy of a slow batch, and how many hedges the token bucket allows.

    Attributes:
        hedge_delay: seconds an attempt may run before another copy is sent (0.1 to 10). With
            ``adaptive_delay``, the delay used until enough latencies have been seen.
        max_tokens: most tokens the bucket can hold (1 to 250).
        refill_ratio: tokens added per successful batch publish (0.001 to 0.2); it caps the
            long-run share of batches that are hedged.
        adaptive_delay: ``None`` (default) for a fixed ``hedge_delay``; an :class:`AdaptiveDelay` to
            follow a percentile of recent latency, e.g.
            ``HedgingSettings(adaptive_delay=AdaptiveDelay(percentile=95))``.
    """

    hedge_delay: float = 1.0
    max_tokens: int = 50
    refill_ratio: float = 0.1
    adaptive_delay: AdaptiveDelay | None = None

    if TYPE_CHECKING:

        def __init__(
            self,
            hedge_delay: _Seconds = 1.0,
            max_tokens: int = 50,
            refill_ratio: float = 0.1,
            adaptive_delay: AdaptiveDelay | None = None,
        ) -> None:
            pass

    def __post_init__(self) -> None:
        object.__setattr__(self, "hedge_delay", _duration("hedge_delay", self.hedge_delay, 0.1, 10))
        object.__setattr__(self, "max_tokens", _whole("max_tokens", self.max_tokens, 1, 250))
        object.__setattr__(self, "refill_ratio", _number("refill_ratio", self.refill_ratio, 0.001, 0.2))
        if self.adaptive_delay is not None and not isinstance(self.adaptive_delay, AdaptiveDelay):
            raise TypeError(
                f"adaptive_delay must be an AdaptiveDelay or None; got {type(self.adaptive_delay).__name__} "
                f"{self.adaptive_delay!r}"
            )

    def __repr__(self) -> str:
        # adaptive_delay only when set, so the common fixed-delay repr stays short.
        adaptive = "" if self.adaptive_delay is None else f", adaptive_delay={self.adaptive_delay!r}"
        return (
            f"HedgingSettings(hedge_delay={self.hedge_delay!r}, max_tokens={self.max_tokens!r}, "
            f"refill_ratio={self.refill_ratio!r}{adaptive})"
        )


def adaptive_delay_limit(retry: RetrySettings) -> float:
    """The most an adaptive hedge delay may be with ``retry``: 10 s, or half the shorter of the initial
    RPC timeout and the total timeout if that is less."""
    return min(MAX_ADAPTIVE_DELAY, min(retry.initial_rpc_timeout, retry.total_timeout) / 2)


def _codes(value: Any) -> frozenset[StatusCode]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"retryable_codes must be a collection of StatusCode; got {type(value).__name__} {value!r}"
        )
    codes = []
    for code in value:
        if isinstance(code, StatusCode):
            codes.append(code)
        elif isinstance(code, str) and code in StatusCode.__members__:
            codes.append(StatusCode[code])
        else:
            raise TypeError(f"retryable_codes must hold StatusCode values; got {code!r}")
    if StatusCode.OK in codes:
        raise ValueError("retryable_codes must not contain OK")
    return frozenset(codes)


@dataclass(frozen=True)
class RetrySettings:
    """How a batch's original attempt is retried: exponential back-off inside a total deadline.

    The defaults are those of the reference Pub/Sub publishers. The n-th retry waits
    ``min(initial_retry_delay * retry_delay_multiplier ** n, max_retry_delay)`` and gets a per-attempt
    timeout of ``min(initial_rpc_timeout * rpc_timeout_multiplier ** n, max_rpc_timeout)``, never past
    the total deadline.
    """

    initial_retry_delay: float = 0.1
    retry_delay_multiplier: float = 4.0
    max_retry_delay: float = 60.0
    initial_rpc_timeout: float = 5.0
    rpc_timeout_multiplier: float = 4.0
    max_rpc_timeout: float = 60.0
    total_timeout: float = 600.0
    retryable_codes: frozenset[StatusCode] = field(default=DEFAULT_RETRYABLE_CODES)

    if TYPE_CHECKING:

        def __init__(
            self,
            initial_retry_delay: _Seconds = 0.1,
            retry_delay_multiplier: float = 4.0,
            max_retry_delay: _Seconds = 60.0,
            initial_rpc_timeout: _Seconds = 5.0,
            rpc_timeout_multiplier: float = 4.0,
            max_rpc_timeout: _Seconds = 60.0,
            total_timeout: _Seconds = 600.0,
            retryable_codes: Iterable[StatusCode] = DEFAULT_RETRYABLE_CODES,
        ) -> None:
            pass

    def __post_init__(self) -> None:
        day = 86_400.0
        for name in ("initial_retry_delay", "max_retry_delay"):
            object.__setattr__(self, name, _duration(name, getattr(self, name), 0, day))
        for name in ("initial_rpc_timeout", "max_rpc_timeout", "total_timeout"):
            object.__setattr__(self, name, _duration(name, getattr(self, name), 0, day, low_open=True))
        for name in ("retry_delay_multiplier", "rpc_timeout_multiplier"):
            object.__setattr__(self, name, _number(name, getattr(self, name), 1.0, 100.0))
        object.__setattr__(self, "retryable_codes", _codes(self.retryable_codes))
        if self.initial_retry_delay > self.max_retry_delay:
            raise ValueError(
                f"initial_retry_delay ({self.initial_retry_delay:g} s) must not exceed "
                f"max_retry_delay ({self.max_retry_delay:g} s)"
            )
        if self.initial_rpc_timeout > self.max_rpc_timeout:
            raise ValueError(
                f"initial_rpc_timeout ({self.initial_rpc_timeout:g} s) must not exceed "
                f"max_rpc_timeout ({self.max_rpc_timeout:g} s)"
            )

    def retry_delay(self, retry_number: int) -> float:
        """Seconds to wait before retry ``retry_number`` (0 for the first retry)."""
        delay = self.initial_retry_delay * self.retry_delay_multiplier**retry_number
        return min(delay, self.max_retry_delay)

    def rpc_timeout(self, attempt_number: int) -> float:
        """Per-attempt RPC timeout of attempt ``attempt_number`` (0 for the first try)."""
        timeout = self.initial_rpc_timeout * self.rpc_timeout_multiplier**attempt_number
        return min(timeout, self.max_rpc_timeout)


@dataclass(frozen=True)
class BatchSettings:
    """When a batch is sent: at ``max_messages`` messages, ``max_bytes`` bytes or ``max_latency``
    seconds after its first message, whichever comes first."""

    max_messages: int = 100
    max_bytes: int = 1_000_000
    max_latency: float = 0.01

    if TYPE_CHECKING:

        def __init__(
            self, max_messages: int = 100, max_bytes: int = 1_000_000, max_latency: _Seconds = 0.01
        ) -> None:
            pass

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "max_messages",
            _whole("max_messages", self.max_messages, 1, MAX_MESSAGES_PER_REQUEST),
        )
        object.__setattr__(self, "max_bytes", _whole("max_bytes", self.max_bytes, 1, MAX_REQUEST_BYTES))
        object.__setattr__(self, "max_latency", _duration("max_latency", self.max_latency, 0, 3600))


class LimitExceededBehavior(str, enum.Enum):
    """What ``publish`` does when flow control's limits would be exceeded."""

    #: Publish anyway: flow control is off.
    IGNORE = "ignore"
    #: Wait (in ``publish``) until enough earlier messages have been published.
    BLOCK = "block"
    #: Raise :class:`~hedgepub.FlowControlLimitError` at once.
    ERROR = "error"


@dataclass(frozen=True)
class FlowControlSettings:
    """Limits on messages published but not yet answered, and what to do when they are reached."""

    message_limit: int = 1000
    byte_limit: int = 10_000_000
    limit_exceeded_behavior: LimitExceededBehavior = LimitExceededBehavior.IGNORE

    def __post_init__(self) -> None:
        object.__setattr__(self, "message_limit", _whole("message_limit", self.message_limit, 1, 2**62))
        object.__setattr__(self, "byte_limit", _whole("byte_limit", self.byte_limit, 1, 2**62))
        behavior = self.limit_exceeded_behavior
        if not isinstance(behavior, LimitExceededBehavior):
            try:
                behavior = LimitExceededBehavior(behavior)
            except ValueError:
                allowed = ", ".join(member.name for member in LimitExceededBehavior)
                raise ValueError(
                    f"limit_exceeded_behavior must be one of {allowed}; got {behavior!r}"
                ) from None
        object.__setattr__(self, "limit_exceeded_behavior", behavior)


def check_hedging(
    hedging: HedgingSettings | None, retry: RetrySettings, enable_message_ordering: bool = False
) -> None:
    """Refuse hedging settings that cannot work with ``retry``.

    Raises ``ValueError``, naming both values, when the hedge delay is not strictly shorter than the
    initial RPC timeout or the total timeout, or when an adaptive delay would have no room under half of
    them. ``enable_message_ordering`` is accepted and changes nothing: hedging combines with message
    ordering, since a batch with an ordering key is never hedged (docs/hedging.md, rule 23).
    """
    if hedging is None:
        return
    if hedging.hedge_delay >= retry.initial_rpc_timeout:
        raise ValueError(
            f"hedge_delay ({hedging.hedge_delay:g} s) must be shorter than the retry settings' "
            f"initial_rpc_timeout ({retry.initial_rpc_timeout:g} s)"
        )
    if hedging.hedge_delay >= retry.total_timeout:
        raise ValueError(
            f"hedge_delay ({hedging.hedge_delay:g} s) must be shorter than the retry settings' "
            f"total_timeout ({retry.total_timeout:g} s)"
        )
    if hedging.adaptive_delay is not None and adaptive_delay_limit(retry) < MIN_ADAPTIVE_DELAY:
        raise ValueError(
            f"adaptive_delay needs room between {MIN_ADAPTIVE_DELAY:g} s and half the retry settings' "
            f"initial_rpc_timeout ({retry.initial_rpc_timeout:g} s) and total_timeout "
            f"({retry.total_timeout:g} s): both must be at least {2 * MIN_ADAPTIVE_DELAY:g} s"
        )
