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
1. draw a delay from the rule's :class:`~hedgepub.server.LatencyMix` and wait for it *before* the
   service handler runs, so an injected delay on ``Publish`` comes before the commit. A call that its
   client cancels (or whose deadline passes) during the delay never reaches the handler, and so stores
   nothing;
2. draw an error from the rule's error rates; a drawn error answers the call with that status code and
   a message saying that it was injected, again without running the handler;
3. otherwise run the real handler.

For ``StreamingPull`` the rule applies once, when the stream opens.

A stall window opens ``PHASE`` into each period, counted from when the injector was made (or last
re-seeded with :meth:`FaultInjector.seed`). Without ``@PHASE`` the phase comes from the injector's seed:
the same seed gives the same windows, and every stall rule of one injector with the same period stalls
at the same moments, as one stalled front end would.

The rules and the text they are written in (``hedgepub serve --fault``, ``--faults-file``) are in
:mod:`.rules`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import grpc
import grpc.aio

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub.server._api.handlers import as_async_iterator, behavior_of, rebuilt, unimplemented_handler
from hedgepub.server._api.request_log import REQUEST_LOG, log_request
from hedgepub.server._faults.counts import FaultCounts, MutableCounts
from hedgepub.server._faults.delays import StallWindows
from hedgepub.server._faults.rules import FaultRule, parse_fault_spec, read_faults_file
from hedgepub.server._methods import SHORT_NAMES, WILDCARD, resolve_method, short_name

__all__ = ["FaultInjector"]

_log = logging.getLogger(__name__)


class FaultInjector(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic in the stubs only
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
            rules.update(read_faults_file(faults_file))
        if isinstance(specs, str):
            specs = [specs]
        for spec in specs:
            method, rule = parse_fault_spec(spec)
            rules[method] = rules[method].merged(rule) if method in rules else rule
        return cls(rules, seed=seed, clock=clock)

    def __repr__(self) -> str:
        rules = ", ".join(f"{name}: {rule}" for name, rule in self.rules.items())
        return f"<FaultInjector {{{rules}}}>"

    # -- the interceptor -----------------------------------------------------------------------------

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
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
        self, handler: grpc.RpcMethodHandler[Any, Any], name: str, rule: FaultRule | None, log_requests: bool
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behavior = behavior_of(handler)
        inject = self._inject

        async def before(request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if rule is not None:
                await inject(name, rule, context)

        wrapped: Callable[..., Any]
        if handler.response_streaming:
            if inspect.iscoroutinefunction(behavior):
                # The handler writes with context.write() and returns nothing.
                async def writes(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                    started, cancelled = self._clock.now(), False
                    try:
                        await before(request, context)
                        await behavior(request, context)
                    except asyncio.CancelledError:
                        cancelled = True
                        raise
                    finally:
                        if log_requests:
                            log_request(name, context, self._clock.now() - started, cancelled)

                wrapped = writes
            else:

                async def streams(
                    request: Any, context: grpc.aio.ServicerContext[Any, Any]
                ) -> AsyncIterator[Any]:
                    started, cancelled = self._clock.now(), False
                    try:
                        await before(request, context)
                        async for response in as_async_iterator(behavior(request, context)):
                            yield response
                    except asyncio.CancelledError:
                        cancelled = True
                        raise
                    finally:
                        if log_requests:
                            log_request(name, context, self._clock.now() - started, cancelled)

                wrapped = streams

        else:

            async def answers(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started, cancelled = self._clock.now(), False
                try:
                    await before(request, context)
                    result = behavior(request, context)
                    if inspect.isawaitable(result):
                        result = await result
                    return result
                except asyncio.CancelledError:
                    cancelled = True
                    raise
                finally:
                    if log_requests:
                        log_request(name, context, self._clock.now() - started, cancelled)

            wrapped = answers
        return rebuilt(handler, wrapped)

    async def _inject(self, name: str, rule: FaultRule, context: grpc.aio.ServicerContext[Any, Any]) -> None:
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
