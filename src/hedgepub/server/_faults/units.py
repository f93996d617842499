"""The numbers of the fault rule language: durations (``250us``, ``5ms``, ``1.5s``) and percentages
(``20%``) read and written as text, and the checks of probabilities and seconds given as numbers.

What is written parses back to the same value (``LatencyMix.parse(str(mix)) == mix``).
"""

from __future__ import annotations

import math
import re

__all__ = [
    "TOLERANCE",
    "check_probability",
    "check_seconds",
    "format_duration",
    "format_percent",
    "parse_duration",
    "parse_percent",
]

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION_RE = re.compile(rf"^{_NUMBER}\s*(us|µs|ms|s)$")
_PERCENT_RE = re.compile(rf"^{_NUMBER}\s*%$")
_UNIT_SECONDS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
#: How far a sum of probabilities may pass 1: sums such as 33.3% * 3 must not fail on float rounding.
TOLERANCE = 1e-9


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``"5ms"`` (units ``us``, ``µs``, ``ms``, ``s``)."""
    match = _DURATION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"bad duration {text.strip()!r}: expected a number followed by us, ms or s, "
            "such as '5ms' or '1.5s'"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_percent(text: str) -> float:
    """The probability of a percentage such as ``"20%"`` (``0.2``)."""
    match = _PERCENT_RE.match(text.strip())
    if match is None:
        raise ValueError(f"bad percentage {text.strip()!r}: expected a number followed by %, such as '20%'")
    return float(match.group(1)) / 100.0


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it at 1 or more: ``"5ms"``, ``"1.5s"``."""
    if seconds == 0:
        return "0ms"
    if seconds >= 1:
        return f"{seconds:.6g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.6g}ms"
    return f"{seconds * 1e6:.6g}us"


def format_percent(probability: float) -> str:
    """``probability`` as a percentage: ``"20%"``."""
    return f"{probability * 100:.6g}%"


def check_probability(name: str, value: object) -> float:
    """``value`` as a float in (0, 1]; ``TypeError`` or ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a probability as an int or float; got {type(value).__name__} {value!r}"
        )
    probability = float(value)
    if math.isnan(probability) or not 0.0 < probability <= 1.0:
        raise ValueError(f"{name} must be a probability in (0, 1]; got {value!r}")
    return probability


def check_seconds(name: str, value: object) -> float:
    """``value`` as finite seconds (a float); ``TypeError`` or ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds as an int or float; got {type(value).__name__} {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be finite seconds; got {value!r}")
    return seconds
