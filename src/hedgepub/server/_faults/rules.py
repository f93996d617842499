"""Fault rules: what to do to the calls of one RPC method (stall windows, a latency mix, error rates by
status code), and the text and JSON they are written in.

Text syntax (the ``hedgepub serve --fault`` option; ``FaultInjector.parse``)::

    METHOD:latency=MIX                    MIX = P%:DURATION[,P%:DURATION...] or a single DURATION
    METHOD:error=CODE:P%[,CODE:P%...]     CODE = a status code name, such as UNAVAILABLE
    METHOD:latency=MIX;error=CODE:P%      both at once
    METHOD:stall=STALL/PERIOD[@PHASE]     a STALL-long window every PERIOD (such as 500ms/5s)

Durations take the units ``us``, ``ms`` or ``s`` (``250us``, ``5ms``, ``1.5s``). Percentages of a
latency mix may add up to less than 100: the remainder of the calls gets no added delay, so
``1%:4s`` slows one call in a hundred by four seconds. Error percentages likewise add up to at most
100; the remainder succeeds. A file (``--faults-file``) holds the same rules as JSON::

    {"Publish": {"latency": "95%:5ms,4%:300ms,1%:4s", "errors": {"UNAVAILABLE": 0.2}}}

where an error rate is a fraction (``0.2``) or a percentage string (``"20%"``), and stall windows are
``{"stall": "500ms/5s"}``.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import grpc

from hedgepub._status import StatusCode
from hedgepub.server._faults.delays import LatencyMix, StallWindows
from hedgepub.server._faults.units import TOLERANCE, check_probability, format_percent, parse_percent
from hedgepub.server._methods import resolve_method

__all__ = ["FaultRule", "parse_fault_spec", "read_faults_file"]


def _status_code(value: object) -> StatusCode:
    """A StatusCode from a StatusCode, grpc.StatusCode, int or (case-insensitive) name."""
    if isinstance(value, StatusCode):
        code = value
    elif isinstance(value, grpc.StatusCode):
        code = StatusCode(value.value[0])
    elif isinstance(value, str):
        try:
            code = StatusCode[value.strip().upper()]
        except KeyError:
            names = ", ".join(code.name for code in StatusCode if code is not StatusCode.OK)
            raise ValueError(f"unknown status code {value!r}; valid codes are {names}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            code = StatusCode(value)
        except ValueError:
            raise ValueError(f"unknown status code number {value!r}; valid numbers are 1..16") from None
    else:
        raise TypeError(
            f"a status code must be a StatusCode, name or number; got {type(value).__name__} {value!r}"
        )
    if code is StatusCode.OK:
        raise ValueError("OK is not an error and cannot be injected; use a code such as UNAVAILABLE")
    return code


class FaultRule:
    """What to do to the calls of one method: stall windows, a latency mix and error rates by status code.

    ``FaultRule(latency="95%:5ms,5%:300ms", errors={StatusCode.UNAVAILABLE: 0.2})``. The latency is a
    :class:`LatencyMix` or its text; error rates are probabilities in (0, 1] adding up to at most 1,
    keyed by :class:`~hedgepub.StatusCode` (or ``grpc.StatusCode``, or a code's name); ``stall`` is a
    :class:`StallWindows` or its text (``"500ms/5s"``). Immutable, comparable and hashable;
    ``FaultRule.parse`` reads the ``--fault`` text form.
    """

    __slots__ = ("_errors", "_latency", "_stall")

    def __init__(
        self,
        latency: LatencyMix | str | None = None,
        errors: Mapping[Any, float] | None = None,
        stall: StallWindows | str | None = None,
    ) -> None:
        if isinstance(stall, str):
            stall = StallWindows.parse(stall)
        elif stall is not None and not isinstance(stall, StallWindows):
            raise TypeError(
                f"stall must be a StallWindows, its text or None; got {type(stall).__name__} {stall!r}"
            )
        self._stall: StallWindows | None = stall
        if isinstance(latency, str):
            latency = LatencyMix.parse(latency)
        elif latency is not None and not isinstance(latency, LatencyMix):
            raise TypeError(
                f"latency must be a LatencyMix, its text or None; got {type(latency).__name__} {latency!r}"
            )
        if errors is None:
            errors = {}
        if not isinstance(errors, Mapping):
            raise TypeError(f"errors must be a mapping of status code to probability; got {errors!r}")
        rates: dict[StatusCode, float] = {}
        for key, rate in errors.items():
            code = _status_code(key)
            rates[code] = check_probability(f"error rate of {code.name}", rate)
        total = math.fsum(rates.values())
        if total > 1.0 + TOLERANCE:
            raise ValueError(f"error rates add up to {format_percent(total)}, more than 100%")
        self._latency: LatencyMix | None = latency
        self._errors: Mapping[StatusCode, float] = MappingProxyType(dict(sorted(rates.items())))

    @property
    def latency(self) -> LatencyMix | None:
        """The latency mix, or ``None`` for no added delay."""
        return self._latency

    @property
    def errors(self) -> Mapping[StatusCode, float]:
        """Error probability by status code (read-only)."""
        return self._errors

    @property
    def stall(self) -> StallWindows | None:
        """The stall windows, or ``None`` for none."""
        return self._stall

    @property
    def error_probability(self) -> float:
        """The probability that a call gets an injected error."""
        return math.fsum(self._errors.values())

    @classmethod
    def parse(cls, spec: str) -> FaultRule:
        """Parse a ``--fault`` spec's rule (after ``METHOD:``), such as ``latency=5ms;error=INTERNAL:1%``."""
        if not isinstance(spec, str):
            raise TypeError(f"a fault rule spec must be a str; got {type(spec).__name__} {spec!r}")
        latency: LatencyMix | None = None
        stall: StallWindows | None = None
        errors: dict[StatusCode, float] = {}
        clauses = [clause.strip() for clause in spec.split(";") if clause.strip()]
        if not clauses:
            raise ValueError(
                "empty fault rule: expected 'latency=MIX', 'error=CODE:P%' and/or 'stall=STALL/PERIOD'"
            )
        for clause in clauses:
            key, separator, value = clause.partition("=")
            key = key.strip().lower()
            if not separator or not value.strip():
                raise ValueError(
                    f"bad fault clause {clause!r}: "
                    "expected 'latency=MIX', 'error=CODE:P%' or 'stall=STALL/PERIOD'"
                )
            if key == "stall":
                if stall is not None:
                    raise ValueError(f"stall given twice in {spec!r}")
                stall = StallWindows.parse(value)
            elif key == "latency":
                if latency is not None:
                    raise ValueError(f"latency given twice in {spec!r}")
                latency = LatencyMix.parse(value)
            elif key in ("error", "errors"):
                for item in value.split(","):
                    name, colon, percent = item.strip().partition(":")
                    if not colon:
                        raise ValueError(
                            f"bad error rate {item.strip()!r}: expected CODE:PERCENT, "
                            "such as 'UNAVAILABLE:20%'"
                        )
                    code = _status_code(name)
                    if code in errors:
                        raise ValueError(f"error rate of {code.name} given twice in {spec!r}")
                    errors[code] = parse_percent(percent)
            else:
                raise ValueError(
                    f"unknown fault kind {key!r} in {clause!r}: expected 'latency', 'error' or 'stall'"
                )
        return cls(latency=latency, errors=errors, stall=stall)

    @classmethod
    def from_json(cls, value: object) -> FaultRule:
        """Build a rule from its JSON form: ``{"latency": "95%:5ms,...", "errors": {"UNAVAILABLE": 0.2}}``.

        Stall windows are ``"stall": "500ms/5s"``.
        """
        if not isinstance(value, Mapping):
            raise ValueError(
                f"a fault rule must be a JSON object with 'latency', 'errors' and/or 'stall'; got {value!r}"
            )
        unknown = set(value) - {"latency", "errors", "stall"}
        if unknown:
            raise ValueError(
                f"unknown fault rule keys {sorted(unknown)}: expected 'latency', 'errors' and/or 'stall'"
            )
        latency = value.get("latency")
        if latency is not None and not isinstance(latency, str):
            raise ValueError(f"'latency' must be a string such as '95%:5ms,5%:300ms'; got {latency!r}")
        stall = value.get("stall")
        if stall is not None and not isinstance(stall, str):
            raise ValueError(f"'stall' must be a string such as '500ms/5s'; got {stall!r}")
        raw_errors = value.get("errors") or {}
        if not isinstance(raw_errors, Mapping):
            raise ValueError(f"'errors' must be an object of code name to rate; got {raw_errors!r}")
        errors = {
            name: parse_percent(rate) if isinstance(rate, str) else rate for name, rate in raw_errors.items()
        }
        return cls(latency=latency, errors=errors, stall=stall)

    def merged(self, other: FaultRule) -> FaultRule:
        """This rule updated by ``other``: its latency and stall (if set) replace ours; errors are added."""
        return FaultRule(
            latency=other.latency if other.latency is not None else self.latency,
            errors={**self._errors, **other.errors},
            stall=other.stall if other.stall is not None else self.stall,
        )

    def _draw_error(self, rng: random.Random) -> StatusCode | None:
        if not self._errors:
            return None
        draw = rng.random()
        upper = 0.0
        for code, rate in self._errors.items():
            upper += rate
            if draw < upper:
                return code
        return None

    def __str__(self) -> str:
        clauses = []
        if self._stall is not None:
            clauses.append(f"stall={self._stall}")
        if self._latency is not None:
            clauses.append(f"latency={self._latency}")
        if self._errors:
            clauses.append(
                "error="
                + ",".join(f"{code.name}:{format_percent(rate)}" for code, rate in self._errors.items())
            )
        return ";".join(clauses)

    def __repr__(self) -> str:
        return f"FaultRule.parse({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FaultRule):
            return NotImplemented
        return (
            self._latency == other._latency
            and dict(self._errors) == dict(other._errors)
            and self._stall == other._stall
        )

    def __hash__(self) -> int:
        return hash((self._latency, tuple(self._errors.items()), self._stall))


def parse_fault_spec(spec: str) -> tuple[str, FaultRule]:
    """``"Publish:latency=5ms;error=UNAVAILABLE:20%"`` -> (full path, rule)."""
    if not isinstance(spec, str):
        raise TypeError(f"a fault spec must be a str; got {type(spec).__name__} {spec!r}")
    method, separator, rule_text = spec.partition(":")
    if not separator or not rule_text.strip():
        raise ValueError(
            f"bad fault spec {spec!r}: expected METHOD:latency=MIX and/or METHOD:error=CODE:P%, "
            "such as 'Publish:latency=95%:5ms,5%:300ms' or 'Publish:error=UNAVAILABLE:20%'"
        )
    try:
        return resolve_method(method), FaultRule.parse(rule_text)
    except ValueError as error:
        raise ValueError(f"bad fault spec {spec!r}: {error}") from None


def read_faults_file(path: str | os.PathLike[str]) -> dict[str, FaultRule]:
    """The rules of a ``--faults-file`` by full path; ``ValueError`` naming the file and bad method."""
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except json.JSONDecodeError as error:
        raise ValueError(f"faults file {os.fspath(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"faults file {os.fspath(path)!r} must hold a JSON object of method -> rule")
    rules: dict[str, FaultRule] = {}
    for method, value in document.items():
        try:
            rules[resolve_method(method)] = FaultRule.from_json(value)
        except ValueError as error:
            raise ValueError(f"faults file {os.fspath(path)!r}, method {method!r}: {error}") from None
    return rules
