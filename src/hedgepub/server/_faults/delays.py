"""The delays a fault rule injects: a :class:`LatencyMix` draws one delay per call from weighted buckets
(``"95%:5ms,4%:300ms,1%:4s"``); :class:`StallWindows` hold every call that arrives inside a periodic
window until it ends (``"500ms/5s"``), so that slowness is correlated in time.

Both are immutable values, read from and written as the text of the fault rule language; the injector
(:mod:`.injector`) holds the random generator and the time origin they are given, and does the waiting.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from hedgepub.server._faults.units import (
    TOLERANCE,
    check_probability,
    check_seconds,
    format_duration,
    format_percent,
    parse_duration,
    parse_percent,
)

__all__ = ["LatencyBucket", "LatencyMix", "StallWindows"]


@dataclass(frozen=True)
class LatencyBucket:
    """One weighted delay of a :class:`LatencyMix`: ``probability`` of the calls wait ``delay`` seconds."""

    probability: float
    delay: float

    def __str__(self) -> str:
        return f"{format_percent(self.probability)}:{format_duration(self.delay)}"


class LatencyMix:
    """Weighted delays: each call waits the delay of one bucket, drawn by the buckets' probabilities.

    Build one from ``(probability, delay_seconds)`` pairs, ``LatencyMix([(0.95, 0.005), (0.05, 0.3)])``,
    or from text, ``LatencyMix.parse("95%:5ms,4%:300ms,1%:4s")``. Probabilities add up to at most 1;
    the remainder of the calls gets no delay. Immutable, comparable and hashable.
    """

    __slots__ = ("_buckets", "_cumulative")

    def __init__(self, buckets: Iterable[tuple[float, float] | LatencyBucket]) -> None:
        checked: list[LatencyBucket] = []
        for index, bucket in enumerate(buckets):
            if isinstance(bucket, LatencyBucket):
                probability, delay = bucket.probability, bucket.delay
            else:
                try:
                    probability, delay = bucket
                except (TypeError, ValueError):
                    raise TypeError(
                        f"latency bucket {index} must be a (probability, delay_seconds) pair; got {bucket!r}"
                    ) from None
            probability = check_probability(f"latency bucket {index} probability", probability)
            if isinstance(delay, bool) or not isinstance(delay, (int, float)):
                raise TypeError(
                    f"latency bucket {index} delay must be seconds as an int or float; "
                    f"got {type(delay).__name__} {delay!r}"
                )
            if math.isnan(delay) or math.isinf(delay) or delay < 0:
                raise ValueError(f"latency bucket {index} delay must be finite seconds >= 0; got {delay!r}")
            checked.append(LatencyBucket(probability, float(delay)))
        if not checked:
            raise ValueError("a latency mix needs at least one bucket, such as '100%:5ms'")
        total = math.fsum(bucket.probability for bucket in checked)
        if total > 1.0 + TOLERANCE:
            raise ValueError(
                f"latency mix probabilities add up to {format_percent(total)}, more than 100%: "
                + ",".join(str(bucket) for bucket in checked)
            )
        self._buckets = tuple(checked)
        cumulative: list[float] = []
        running = 0.0
        for bucket in checked:
            running += bucket.probability
            cumulative.append(running)
        self._cumulative = tuple(cumulative)

    @classmethod
    def parse(cls, spec: str) -> LatencyMix:
        """Parse ``"95%:5ms,4%:300ms,1%:4s"``; a lone duration (``"50ms"``) means 100% of the calls."""
        if not isinstance(spec, str):
            raise TypeError(f"a latency mix spec must be a str; got {type(spec).__name__} {spec!r}")
        if not spec.strip():
            raise ValueError("empty latency mix: expected buckets such as '95%:5ms,5%:300ms'")
        parts = [part.strip() for part in spec.split(",")]
        if len(parts) == 1 and ":" not in parts[0] and "%" not in parts[0]:
            return cls([(1.0, parse_duration(parts[0]))])
        buckets: list[tuple[float, float]] = []
        for part in parts:
            percent, separator, duration = part.partition(":")
            if not separator:
                raise ValueError(
                    f"bad latency bucket {part!r} in {spec!r}: expected PERCENT:DURATION, such as '95%:5ms'"
                )
            try:
                buckets.append((parse_percent(percent), parse_duration(duration)))
            except ValueError as error:
                raise ValueError(f"bad latency bucket {part!r} in {spec!r}: {error}") from None
        try:
            return cls(buckets)
        except ValueError as error:
            raise ValueError(f"bad latency mix {spec!r}: {error}") from None

    @classmethod
    def constant(cls, delay: float) -> LatencyMix:
        """Every call waits ``delay`` seconds."""
        return cls([(1.0, delay)])

    @property
    def buckets(self) -> tuple[LatencyBucket, ...]:
        """The buckets as given (without the no-delay remainder)."""
        return self._buckets

    @property
    def no_delay_probability(self) -> float:
        """The share of calls that get no added delay (the remainder below 100%)."""
        return max(0.0, 1.0 - self._cumulative[-1])

    def sample(self, rng: random.Random) -> float:
        """Draw one delay in seconds (``0.0`` for the no-delay remainder)."""
        draw = rng.random()
        for bucket, upper in zip(self._buckets, self._cumulative, strict=True):
            if draw < upper:
                return bucket.delay
        return 0.0

    def __str__(self) -> str:
        if len(self._buckets) == 1 and self._buckets[0].probability == 1.0:
            return format_duration(self._buckets[0].delay)
        return ",".join(str(bucket) for bucket in self._buckets)

    def __repr__(self) -> str:
        return f"LatencyMix.parse({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LatencyMix):
            return NotImplemented
        return self._buckets == other._buckets

    def __hash__(self) -> int:
        return hash(self._buckets)


class StallWindows:
    """Correlated stalls: a window of ``stall`` seconds every ``period`` seconds.

    Every call that arrives inside a window waits until the window ends, then goes on; calls between
    windows are not touched. ``StallWindows(0.5, 5.0)`` stalls 10% of the time, half a second at a time;
    ``StallWindows.parse("500ms/5s")`` is the same. ``phase`` (seconds, ``0 <= phase < period``) is when
    in each period the window opens, counted from the injector's time origin; ``None`` leaves it to the
    injector's seed. Immutable, comparable and hashable.
    """

    __slots__ = ("_period", "_phase", "_stall")

    def __init__(self, stall: float, period: float, phase: float | None = None) -> None:
        stall = check_seconds("stall", stall)
        period = check_seconds("stall period", period)
        if not 0 < stall < period:
            raise ValueError(
                "a stall window must last more than 0 s and less than its period; got "
                f"{format_duration(stall)} every {format_duration(period)}"
            )
        if phase is not None:
            phase = check_seconds("stall phase", phase)
            if not 0 <= phase < period:
                raise ValueError(
                    f"stall phase must be in [0, period) = [0, {format_duration(period)}); got {phase!r}"
                )
        self._stall = stall
        self._period = period
        self._phase = phase

    @classmethod
    def parse(cls, spec: str) -> StallWindows:
        """Parse ``"500ms/5s"`` (phase from the seed) or ``"500ms/5s@1.2s"`` (open 1.2 s into each period)."""
        if not isinstance(spec, str):
            raise TypeError(f"a stall spec must be a str; got {type(spec).__name__} {spec!r}")
        windows, at, phase = spec.partition("@")
        stall, slash, period = windows.partition("/")
        if not slash or (at and not phase.strip()):
            raise ValueError(
                f"bad stall windows {spec.strip()!r}: expected STALL/PERIOD[@PHASE], such as '500ms/5s'"
            )
        try:
            return cls(parse_duration(stall), parse_duration(period), parse_duration(phase) if at else None)
        except ValueError as error:
            raise ValueError(f"bad stall windows {spec.strip()!r}: {error}") from None

    @property
    def stall(self) -> float:
        """How long each window lasts, in seconds."""
        return self._stall

    @property
    def period(self) -> float:
        """Seconds from the opening of one window to the next."""
        return self._period

    @property
    def phase(self) -> float | None:
        """Seconds into each period at which the window opens; ``None``: drawn from the injector's seed."""
        return self._phase

    def wait(self, elapsed: float, phase: float) -> float:
        """How long a call arriving ``elapsed`` seconds after the origin waits, with windows at ``phase``."""
        into_period = (elapsed - phase) % self._period
        return self._stall - into_period if into_period < self._stall else 0.0

    def __str__(self) -> str:
        text = f"{format_duration(self._stall)}/{format_duration(self._period)}"
        return text if self._phase is None else f"{text}@{format_duration(self._phase)}"

    def __repr__(self) -> str:
        return f"StallWindows.parse({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StallWindows):
            return NotImplemented
        return (self._stall, self._period, self._phase) == (other._stall, other._period, other._phase)

    def __hash__(self) -> int:
        return hash((self._stall, self._period, self._phase))
