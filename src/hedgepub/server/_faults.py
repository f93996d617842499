"""Fault injection for the local Pub/Sub server: latency mixes and error rates, per RPC method.

One :class:`FaultInjector` belongs to one server and is that server's only gRPC interceptor, so every
RPC of the ``google.pubsub.v1`` Publisher and Subscriber services and of ``google.iam.v1.IAMPolicy`` can
be slowed down or failed, the bidirectional ``StreamingPull`` included. Rules are keyed by method
(short name such as ``"Publish"``, full path such as ``"/google.pubsub.v1.Publisher/Publish"``, or
``"*"`` for every method without a rule of its own) and can be changed at any time from any thread
while the server runs on its own event loop.

What a rule does to a call, in order:

0. if the rule has stall windows and the call arrives inside one, hold it until the window ends: every
   call arriving in the same window waits, and all are let go together, as when one front end stalls
   (a failover, a pause, an overloaded task). Slowness is then correlated in time, not drawn per call;
1. draw a delay from the rule's :class:`LatencyMix` and wait for it *before* the service handler runs,
   so an injected delay on ``Publish`` comes before the commit. A call that its client cancels (or
   whose deadline passes) during the delay never reaches the handler, and so stores nothing;
2. draw an error from the rule's error rates; a drawn error answers the call with that status code and
   a message saying that it was injected, again without running the handler;
3. otherwise run the real handler.

For ``StreamingPull`` the rule applies once, when the stream opens.

Text syntax (the ``hedgepub serve --fault`` option; :meth:`FaultInjector.parse`)::

    METHOD:latency=MIX                    MIX = P%:DURATION[,P%:DURATION...] or a single DURATION
    METHOD:error=CODE:P%[,CODE:P%...]     CODE = a status code name, such as UNAVAILABLE
    METHOD:latency=MIX;error=CODE:P%      both at once
    METHOD:stall=STALL/PERIOD[@PHASE]     a STALL-long window every PERIOD (such as 500ms/5s)

A stall window opens ``PHASE`` into each period, counted from when the injector was made (or last
re-seeded with :meth:`FaultInjector.seed`). Without ``@PHASE`` the phase comes from the injector's seed:
the same seed gives the same windows, and every stall rule of one injector with the same period stalls
at the same moments, as one stalled front end would.

Durations take the units ``us``, ``ms`` or ``s`` (``250us``, ``5ms``, ``1.5s``). Percentages of a
latency mix may add up to less than 100: the remainder of the calls gets no added delay, so
``1%:4s`` slows one call in a hundred by four seconds. Error percentages likewise add up to at most
100; the remainder succeeds. A file (``--faults-file``) holds the same rules as JSON::

    {"Publish": {"latency": "95%:5ms,4%:300ms,1%:4s", "errors": {"UNAVAILABLE": 0.2}}}

where an error rate is a fraction (``0.2``) or a percentage string (``"20%"``), and stall windows are
``{"stall": "500ms/5s"}``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import grpc
import grpc.aio

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub._status import StatusCode
from hedgepub.server._fault_counts import FaultCounts, MutableCounts
from hedgepub.server._fault_delays import LatencyMix, StallWindows
from hedgepub.server._fault_units import (
    TOLERANCE,
    check_probability,
    format_percent,
    parse_percent,
)
from hedgepub.server._handlers import as_async_iterator, behavior_of, rebuilt, unimplemented_handler
from hedgepub.server._methods import SHORT_NAMES, WILDCARD, resolve_method, short_name
from hedgepub.server._request_log import REQUEST_LOG, log_request

__all__ = [
    "FaultInjector",
    "FaultRule",
]

_log = logging.getLogger(__name__)


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


class FaultInjector(grpc.aio.ServerInterceptor):
    """A server's fault rules, applied to its calls as its one gRPC interceptor.

    ``FaultInjector({"Publish": FaultRule(latency="95%:5ms,5%:300ms")}, seed=7)``; pass it to
    ``grpc.aio.server(interceptors=[injector])`` (``LocalServer`` does, and exposes it as
    ``server.faults``). :meth:`set` and :meth:`clear` may be called from any thread while the server
    runs; a call uses the rule in force when it arrived. ``seed`` makes the draws repeatable (for the
    same order of calls) and fixes the phase of stall windows that leave it open; those windows are
    counted from the injector's time origin, its creation or its last :meth:`seed`. :attr:`counts` is a
    snapshot of every injected event.
    """

    def __init__(
        self,
        rules: Mapping[str, FaultRule | str] | None = None,
        seed: int | None = None,
        *,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._clock = clock
        self._origin = clock.now()
        self._stall_fraction = _stall_fraction(seed)
        # Replaced, never mutated, so the interceptor reads it without taking the lock.
        self._rules: Mapping[str, FaultRule] = {}
        self._counts: dict[str, MutableCounts] = {}
        for method, rule in (rules or {}).items():
            self.set(method, rule)

    # -- configuration -------------------------------------------------------------------------------

    def set(self, method: str, rule: FaultRule | str | None) -> None:
        """Apply ``rule`` to ``method`` (short name, full path or ``"*"``); ``None`` removes its rule.

        A string is parsed as the rule part of a ``--fault`` spec (``"latency=5ms;error=INTERNAL:1%"``).
        """
        path = resolve_method(method)
        if isinstance(rule, str):
            rule = FaultRule.parse(rule)
        elif rule is not None and not isinstance(rule, FaultRule):
            raise TypeError(f"rule must be a FaultRule, its text or None; got {type(rule).__name__} {rule!r}")
        with self._lock:
            rules = dict(self._rules)
            if rule is None:
                rules.pop(path, None)
            else:
                rules[path] = rule
            self._rules = rules
        _log.info("fault rule for %s: %s", short_name(path), rule if rule is not None else "none")

    def get(self, method: str) -> FaultRule | None:
        """The rule set for ``method`` itself (not the ``"*"`` rule it may fall back to), or ``None``."""
        return self._rules.get(resolve_method(method))

    def clear(self) -> None:
        """Remove every rule (the counts are kept; see :meth:`reset_counts`)."""
        with self._lock:
            self._rules = {}
        _log.info("fault rules cleared")

    def reset_counts(self) -> None:
        """Forget every counted event."""
        with self._lock:
            self._counts = {}

    def seed(self, seed: int | None) -> None:
        """Restart the random draws from ``seed``, and the stall windows' time origin from now."""
        with self._lock:
            self._rng = random.Random(seed)
            self._origin = self._clock.now()
            self._stall_fraction = _stall_fraction(seed)

    def stall_phase(self, windows: StallWindows) -> float:
        """When in each period ``windows`` open (seconds): their phase, or the seed's share of the period."""
        return windows.phase if windows.phase is not None else self._stall_fraction * windows.period

    @property
    def rules(self) -> Mapping[str, FaultRule]:
        """The rules in force, by short method name (``"*"`` for the catch-all)."""
        return MappingProxyType({short_name(path): rule for path, rule in self._rules.items()})

    @property
    def counts(self) -> FaultCounts:
        """A snapshot of every injected event, by method."""
        with self._lock:
            return FaultCounts({name: counts.freeze() for name, counts in self._counts.items()})

    @classmethod
    def parse(
        cls,
        specs: Iterable[str] = (),
        *,
        faults_file: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        clock: Clock = DEFAULT_CLOCK,
    ) -> FaultInjector:
        """Build an injector from ``--fault`` specs (``"Publish:latency=5ms"``) and/or a JSON file.

        The file's rules come first; a spec for the same method then adds to them (its latency replaces
        the file's, its error rates are added). Raises ``ValueError`` naming the bad spec.
        """
        rules: dict[str, FaultRule] = {}
        if faults_file is not None:
            rules.update(_read_faults_file(faults_file))
        if isinstance(specs, str):
            specs = [specs]
        for spec in specs:
            method, rule = _parse_fault_spec(spec)
            rules[method] = rules[method].merged(rule) if method in rules else rule
        return cls(rules, seed=seed, clock=clock)

    def __repr__(self) -> str:
        rules = ", ".join(f"{name}: {rule}" for name, rule in self.rules.items())
        return f"<FaultInjector {{{rules}}}>"

    # -- the interceptor -----------------------------------------------------------------------------

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the handler of a call that meets a rule; return it unchanged otherwise."""
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        rules = self._rules
        rule = rules.get(path) if rules else None
        if rule is None and rules and path in SHORT_NAMES:
            rule = rules.get(WILDCARD)
        log_requests = REQUEST_LOG.isEnabledFor(logging.DEBUG)
        if rule is None and not log_requests:
            return handler
        if handler is None:
            if rule is None or path not in SHORT_NAMES:
                return handler
            # The server does not implement this method; the fault still applies, then UNIMPLEMENTED.
            handler = unimplemented_handler(short_name(path))
        return self._wrap(handler, short_name(path), rule, log_requests)

    def _wrap(
        self, handler: grpc.RpcMethodHandler, name: str, rule: FaultRule | None, log_requests: bool
    ) -> grpc.RpcMethodHandler:
        behavior = behavior_of(handler)
        inject = self._inject

        async def before(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            if rule is not None:
                await inject(name, rule, context)

        if handler.response_streaming:
            if inspect.iscoroutinefunction(behavior):
                # The handler writes with context.write() and returns nothing.
                async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> None:
                    started = self._clock.now()
                    try:
                        await before(request, context)
                        await behavior(request, context)
                    finally:
                        if log_requests:
                            log_request(name, context, self._clock.now() - started)

            else:

                async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # type: ignore[misc]
                    started = self._clock.now()
                    try:
                        await before(request, context)
                        async for response in as_async_iterator(behavior(request, context)):
                            yield response
                    finally:
                        if log_requests:
                            log_request(name, context, self._clock.now() - started)

        else:

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                started = self._clock.now()
                try:
                    await before(request, context)
                    result = behavior(request, context)
                    if inspect.isawaitable(result):
                        result = await result
                    return result
                finally:
                    if log_requests:
                        log_request(name, context, self._clock.now() - started)

        return rebuilt(handler, wrapped)

    async def _inject(self, name: str, rule: FaultRule, context: grpc.aio.ServicerContext) -> None:
        with self._lock:
            counts = self._counts.get(name)
            if counts is None:
                counts = self._counts[name] = MutableCounts()
            counts.calls += 1
            stall = 0.0
            if rule.stall is not None:
                stall = rule.stall.wait(self._clock.now() - self._origin, self.stall_phase(rule.stall))
                if stall > 0:
                    counts.stalled += 1
            delay = rule.latency.sample(self._rng) if rule.latency is not None else 0.0
            if delay > 0:
                counts.delays[delay] = counts.delays.get(delay, 0) + 1
        # The stall comes first: a call let go at the end of its window then gets its drawn delay.
        delay += stall
        if delay > 0:
            try:
                await self._clock.sleep(delay)
            except asyncio.CancelledError:
                # The client cancelled (or its deadline passed): the handler never runs.
                self._count_cancelled(name)
                raise
            remaining = context.time_remaining()
            if context.cancelled() or (remaining is not None and remaining <= 0):
                # The cancellation may not have reached this task yet; still, nobody waits for an answer.
                self._count_cancelled(name)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline passed during a delay injected on {name} by hedgepub fault injection",
                )
        if rule.errors:
            with self._lock:
                code = rule._draw_error(self._rng)
                if code is not None:
                    counts.errors[code] = counts.errors.get(code, 0) + 1
            if code is not None:
                await context.abort(
                    grpc.StatusCode[code.name],
                    f"{code.name} injected on {name} by hedgepub fault injection",
                )

    def _count_cancelled(self, name: str) -> None:
        with self._lock:
            counts = self._counts.get(name)
            if counts is not None:
                counts.cancelled_during_delay += 1


def _stall_fraction(seed: int | None) -> float:
    """Where in their period the seed puts stall windows, as a share of the period in [0, 1).

    Its own generator, so that stall rules neither take draws from the latency and error sequence nor
    depend on the order rules were set in.
    """
    return random.Random(None if seed is None else f"hedgepub-stall-{seed}").random()


def _parse_fault_spec(spec: str) -> tuple[str, FaultRule]:
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


def _read_faults_file(path: str | os.PathLike[str]) -> dict[str, FaultRule]:
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
