"""What a :class:`~.injector.FaultInjector` did, counted per RPC method: calls that met a
rule, injected delays by length, injected errors by status code, stalls, and calls cut short by their
client during a delay.

The injector keeps one :class:`MutableCounts` per method under its lock; :class:`FaultCounts` is the
read-only snapshot it hands out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hedgepub._status import StatusCode
from hedgepub.server._methods import WILDCARD, resolve_method, short_name

__all__ = ["FaultCounts", "MethodFaultCounts", "MutableCounts"]


@dataclass(frozen=True)
class MethodFaultCounts:
    """What the injector did to one method's calls (a snapshot)."""

    #: Calls that met a rule (calls of methods without a rule are not counted).
    calls: int = 0
    #: Injected delays by their length in seconds (draws of the no-delay remainder are not counted).
    delays: Mapping[float, int] = field(default_factory=dict)
    #: Injected errors by status code.
    errors: Mapping[StatusCode, int] = field(default_factory=dict)
    #: Calls cancelled by their client (or past their deadline) during an injected delay or stall.
    cancelled_during_delay: int = 0
    #: Calls that arrived in a stall window and were held until it ended.
    stalled: int = 0

    @property
    def delayed(self) -> int:
        """Calls that got an injected delay."""
        return sum(self.delays.values())

    @property
    def failed(self) -> int:
        """Calls answered with an injected error."""
        return sum(self.errors.values())


class FaultCounts(Mapping[str, MethodFaultCounts]):
    """Snapshot of injected events, by short method name.

    Indexing accepts a short name or a full path, and gives zero counts for a valid method that saw no
    rule; iteration lists only the methods that did.
    """

    def __init__(self, by_method: Mapping[str, MethodFaultCounts]) -> None:
        self._by_method = dict(by_method)

    def __getitem__(self, method: str) -> MethodFaultCounts:
        path = resolve_method(method)
        if path == WILDCARD:
            raise KeyError("counts are kept per method; '*' is not a method")
        return self._by_method.get(short_name(path), MethodFaultCounts())

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_method)

    def __len__(self) -> int:
        return len(self._by_method)

    @property
    def calls(self) -> int:
        """Calls that met a rule, over all methods."""
        return sum(counts.calls for counts in self._by_method.values())

    @property
    def delayed(self) -> int:
        """Injected delays over all methods."""
        return sum(counts.delayed for counts in self._by_method.values())

    @property
    def failed(self) -> int:
        """Injected errors over all methods."""
        return sum(counts.failed for counts in self._by_method.values())

    @property
    def stalled(self) -> int:
        """Calls held by a stall window, over all methods."""
        return sum(counts.stalled for counts in self._by_method.values())

    def __repr__(self) -> str:
        return f"FaultCounts({self._by_method!r})"


class MutableCounts:
    """One method's counts as the injector adds to them (under its lock)."""

    __slots__ = ("calls", "cancelled_during_delay", "delays", "errors", "stalled")

    def __init__(self) -> None:
        self.calls = 0
        self.delays: dict[float, int] = {}
        self.errors: dict[StatusCode, int] = {}
        self.cancelled_during_delay = 0
        self.stalled = 0

    def freeze(self) -> MethodFaultCounts:
        """A snapshot of the counts so far."""
        return MethodFaultCounts(
            calls=self.calls,
            delays=MappingProxyType(dict(sorted(self.delays.items()))),
            errors=MappingProxyType(dict(sorted(self.errors.items()))),
            cancelled_during_delay=self.cancelled_during_delay,
            stalled=self.stalled,
        )
