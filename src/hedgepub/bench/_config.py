"""What the bench runs: :class:`BenchConfig` (messages, rate, latency mix or stall windows, hedge delays,
bucket, warm-up, scenario), checked when it is made, and the publishers it names (:class:`PublisherSpec`).
The run itself is :mod:`hedgepub.bench._experiment`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from hedgepub import AdaptiveDelay, HedgingSettings
from hedgepub.bench._report import UNHEDGED
from hedgepub.bench._schedule import Arrivals

#: The latency mix Google's Go client uses to test hedging: mostly fast, a slow tier and a very slow tail.
DEFAULT_MIX = "95%:5ms,4%:300ms,1%:4s"
#: Most warm-up publishes per publisher, whatever the bucket needs (a tiny refill ratio would need 250,000).
MAX_WARMUP = 5_000

#: A hedged publisher's delay: fixed seconds, ``"auto"`` for :class:`~hedgepub.AdaptiveDelay` (p95), or
#: ``"auto:P"`` for the adaptive delay at percentile P (publisher ``adaptive-pP``).
HedgeDelayChoice = float | str
#: The name of the adaptive publisher (``"auto"`` in ``hedge_delays``).
ADAPTIVE = "adaptive"
#: What the bench injects: a latency mix drawn per call, stall windows on one of two servers, or a
#: network fault on real TCP (packet loss, a dead connection, a lost SYN).
Scenario = Literal[
    "latency-mix", "correlated-stalls", "reference", "packet-loss", "dead-connection", "lost-syn"
]
#: The scenarios whose fault is on the network between publisher and server (:mod:`._network`).
NETWORK_SCENARIOS: tuple[str, ...] = ("packet-loss", "dead-connection", "lost-syn")
SCENARIOS: tuple[str, ...] = ("latency-mix", "correlated-stalls", "reference", *NETWORK_SCENARIOS)
#: Where a network scenario's fault comes from: the kernel's packet filter in a namespace of its own
#: (root, Linux), the userspace relay, or ``auto`` (the kernel where it works, else the relay).
Harness = Literal["auto", "kernel", "relay"]
HARNESSES: tuple[str, ...] = ("auto", "kernel", "relay")
#: The stall windows of the correlated-stalls scenario: 500 ms every 5 s.
DEFAULT_STALL = "500ms/5s"
#: The publishers of the correlated-stalls scenario, as ``results.json`` names them.
HEDGED = "hedged"
CROSS_ENDPOINT = "cross_endpoint"
#: The hedged publishers of the network scenarios: one connection (the hedge rides the original's), and
#: a pool of two (the hedge goes on the other one).
SAME_CONNECTION = "same_connection"
OTHER_CONNECTION = "other_connection"


@dataclass(frozen=True)
class PublisherSpec:
    """One publisher of the bench: its name (a column of the table, a key of ``results.json``, a topic)
    and its hedging settings (``None``: unhedged)."""

    name: str
    hedging: HedgingSettings | None
    #: Whether its hedges go to the correlated-stalls scenario's second server.
    cross_endpoint: bool = False
    #: Its ``channel_pool_size`` (``None``: the publisher's default).
    pool_size: int | None = None


def _percentile_of(choice: str) -> float:
    """The percentile of an ``auto:P`` choice, e.g. ``auto:90`` -> 90.0 (AdaptiveDelay checks its range)."""
    try:
        return float(choice.removeprefix("auto:"))
    except ValueError:
        raise ValueError(f"{choice!r}: the percentile after 'auto:' must be a number, e.g. auto:90") from None


def fixed_name(delay: float) -> str:
    """The name of the publisher hedging after a fixed ``delay`` seconds, e.g. ``fixed-100ms``."""
    return f"fixed-{delay * 1000:g}ms"


@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs. The defaults take about a minute and show the effect clearly.

    Attributes:
        messages: measured publishes per publisher.
        rate: publishes per second per publisher (both publish at every arrival).
        mix: latency mix injected on Publish, in the fault injector's syntax.
        hedge_delays: one hedged publisher per entry: seconds before a hedge is sent (0.1 to 10), or
            ``"auto"`` for the adaptive delay (95th percentile of recent latency, starting from the
            default 1 s until it has 100 samples). The default compares 0.1 s, well under the slow
            tiers of the mix, with the adaptive delay.
        max_tokens: each hedged publisher's token bucket size.
        refill_ratio: tokens added per successful batch.
        seed: seeds the arrival schedule and the injected latencies, so a run can be repeated.
        warmup: warm-up publishes per publisher; ``None`` warms up until the token bucket is full.
        arrivals: ``poisson`` (exponential gaps) or ``fixed`` (equal gaps).
        scenario: ``latency-mix`` (the mix on one server) or ``correlated-stalls`` (stall windows on the
            primary of two servers; ``mix`` is not used, and ``hedge_delays`` holds one fixed delay).
        stall: the correlated-stalls scenario's windows, ``STALL/PERIOD`` (the phase comes from ``seed``).
        idempotency_key: every publisher stamps idempotency keys (``idempotency_attribute=True``).
        dedup_hedges: the servers store each hedged batch once (``hedgepub serve --dedup-hedges``).
        message_size: bytes of data per message (0: a short unique payload of about 20 bytes).
        warmup_seconds: when above 0, the warm-up is this many seconds of the measured workload itself
            (same schedule, latency injected, nothing recorded) instead of fast publishes until the
            bucket is full; the ``reference`` scenario's 5 s.
        loss: the ``packet-loss`` scenario's probability that a packet (kernel) or a segment (relay) is
            lost, both ways, from the measured period on.
        blackhole: the ``dead-connection`` scenario's window, in seconds: every publisher's busiest
            connection (the one its originals ride) delivers nothing, a quarter into the measured period.
        syn_loss: the ``lost-syn`` scenario's probability that a connection's SYN is lost (kernel: each
            SYN, retransmissions too; relay: each connection's set-up delayed by 1 s).
        network: where a network scenario's fault comes from: ``kernel``, ``relay`` or ``auto``.
    """

    messages: int = 2_000
    rate: float = 40.0
    mix: str = DEFAULT_MIX
    hedge_delays: tuple[HedgeDelayChoice, ...] = (0.1, "auto")
    max_tokens: int = 50
    refill_ratio: float = 0.1
    seed: int = 1
    warmup: int | None = None
    arrivals: Arrivals = "poisson"
    scenario: Scenario = "latency-mix"
    stall: str = DEFAULT_STALL
    idempotency_key: bool = True
    dedup_hedges: bool = False
    message_size: int = 0
    warmup_seconds: float = 0.0
    loss: float = 0.02
    blackhole: float = 5.0
    syn_loss: float = 0.5
    network: Harness = "auto"

    @classmethod
    def reference(cls, **changes: Any) -> BenchConfig:
        """The ``reference`` scenario: the Go and Rust clients' hedging benchmark workload (see above)."""
        settings: dict[str, Any] = {
            "scenario": "reference",
            "mix": DEFAULT_MIX,
            "rate": 200.0,
            "messages": 6_000,  # 30 s at 200/s
            "arrivals": "fixed",
            "message_size": 1024,
            "warmup_seconds": 5.0,
            "hedge_delays": (0.1,),
            "max_tokens": 50,
            "refill_ratio": 0.1,
        }
        settings.update(changes)
        return cls(**settings)

    @classmethod
    def network_fault(cls, scenario: str, **changes: Any) -> BenchConfig:
        """A network scenario (``packet-loss``, ``dead-connection`` or ``lost-syn``) with its defaults:
        1 KiB single-message publishes at 100/s at fixed intervals for 30 s, hedging after 100 ms; the
        ``lost-syn`` one with no warm-up (the first publishes need the connections)."""
        settings: dict[str, Any] = {
            "scenario": scenario,
            "rate": 100.0,
            "messages": 3_000,
            "arrivals": "fixed",
            "message_size": 1024,
            "hedge_delays": (0.1,),
        }
        if scenario == "lost-syn":
            settings["warmup"] = 0
        settings.update(changes)
        return cls(**settings)

    @property
    def network_scenario(self) -> bool:
        """Whether the fault is on the network (packet loss, a dead connection, a lost SYN)."""
        return self.scenario in NETWORK_SCENARIOS

    def __post_init__(self) -> None:
        if isinstance(self.messages, bool) or not isinstance(self.messages, int) or self.messages < 1:
            raise ValueError(f"messages must be a whole number >= 1; got {self.messages!r}")
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a finite number of publishes per second > 0; got {self.rate!r}")
        if self.warmup is not None and not 0 <= self.warmup <= MAX_WARMUP:
            raise ValueError(f"warmup must be in [0, {MAX_WARMUP}]; got {self.warmup!r}")
        if isinstance(self.message_size, bool) or not isinstance(self.message_size, int):
            raise TypeError(f"message_size must be a whole number of bytes; got {self.message_size!r}")
        if not 0 <= self.message_size <= 10_000_000:
            raise ValueError(f"message_size must be in [0, 10000000] bytes; got {self.message_size!r}")
        if not (math.isfinite(self.warmup_seconds) and 0 <= self.warmup_seconds <= 3_600):
            raise ValueError(f"warmup_seconds must be in [0, 3600]; got {self.warmup_seconds!r}")
        if self.arrivals not in ("poisson", "fixed"):
            raise ValueError(f"arrivals must be 'poisson' or 'fixed'; got {self.arrivals!r}")
        if isinstance(self.hedge_delays, (str, bytes)) or not isinstance(self.hedge_delays, tuple):
            raise TypeError(f"hedge_delays must be a tuple; got {self.hedge_delays!r}")
        if not self.hedge_delays:
            raise ValueError("hedge_delays must name at least one hedged publisher")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}; got {self.scenario!r}")
        if self.scenario == "correlated-stalls":
            from hedgepub.server import StallWindows

            StallWindows.parse(self.stall)  # raises ValueError naming the problem
            if len(self.hedge_delays) != 1 or self.hedge_delays[0] == "auto":
                raise ValueError(
                    "the correlated-stalls scenario compares one fixed hedge delay on the primary and "
                    f"across endpoints; give one, such as --hedge-delay 0.1 (got {self.hedge_delays!r})"
                )
        for what, value, low, high in (
            ("loss", self.loss, 0.0, 1.0),
            ("syn_loss", self.syn_loss, 0.0, 1.0),
            ("blackhole", self.blackhole, 0.0, 600.0),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low < value <= high):
                raise ValueError(f"{what} must be above {low:g} and at most {high:g}; got {value!r}")
        if self.network not in HARNESSES:
            raise ValueError(f"network must be one of {', '.join(HARNESSES)}; got {self.network!r}")
        if self.network_scenario and (len(self.hedge_delays) != 1 or isinstance(self.hedge_delays[0], str)):
            raise ValueError(
                f"the {self.scenario} scenario compares one fixed hedge delay on the same connection and "
                f"on another; give one, such as --hedge-delay 0.1 (got {self.hedge_delays!r})"
            )
        names = [spec.name for spec in self.publishers()]  # validates every delay, max_tokens, refill_ratio
        if len(set(names)) != len(names):
            raise ValueError(f"hedge_delays must not repeat a delay; got {self.hedge_delays!r}")

    def publishers(self) -> tuple[PublisherSpec, ...]:
        """Every publisher of the run, in the order they are shown: unhedged first."""
        specs = [PublisherSpec(UNHEDGED, None, pool_size=1 if self.network_scenario else None)]
        if self.network_scenario:
            delay = self.hedge_delays[0]
            if isinstance(delay, str):
                raise ValueError(f"the {self.scenario} scenario needs a fixed hedge delay; got {delay!r}")
            hedging = HedgingSettings(
                hedge_delay=delay, max_tokens=self.max_tokens, refill_ratio=self.refill_ratio
            )
            return (
                *specs,
                PublisherSpec(SAME_CONNECTION, hedging, pool_size=1),
                PublisherSpec(OTHER_CONNECTION, hedging, pool_size=2),
            )
        if self.scenario == "correlated-stalls":
            delay = self.hedge_delays[0]
            if isinstance(delay, str):
                raise ValueError(f"the correlated-stalls scenario needs a fixed hedge delay; got {delay!r}")
            hedging = HedgingSettings(
                hedge_delay=delay, max_tokens=self.max_tokens, refill_ratio=self.refill_ratio
            )
            return (*specs, PublisherSpec(HEDGED, hedging), PublisherSpec(CROSS_ENDPOINT, hedging, True))
        for delay in self.hedge_delays:
            if isinstance(delay, str) and (delay == "auto" or delay.startswith("auto:")):
                percentile = 95.0 if delay == "auto" else _percentile_of(delay)
                hedging = HedgingSettings(
                    max_tokens=self.max_tokens,
                    refill_ratio=self.refill_ratio,
                    adaptive_delay=AdaptiveDelay(percentile=percentile),
                )
                # adaptive_delay: the one just given
                name = ADAPTIVE if delay == "auto" else f"{ADAPTIVE}-p{hedging.adaptive_delay.percentile:g}"  # type: ignore[union-attr]
                specs.append(PublisherSpec(name, hedging))
                continue
            if isinstance(delay, str):
                raise ValueError(
                    f"hedge_delay must be seconds (0.1 to 10), 'auto' or 'auto:PERCENTILE'; got {delay!r}"
                )
            hedging = HedgingSettings(
                hedge_delay=delay, max_tokens=self.max_tokens, refill_ratio=self.refill_ratio
            )
            specs.append(PublisherSpec(fixed_name(hedging.hedge_delay), hedging))
        return tuple(specs)

    def warmup_target(self) -> int:
        """Warm-up publishes per publisher: as given, or enough successes to fill the token bucket.

        With ``warmup_seconds``, the warm-up is part of the schedule instead: this is 0.
        """
        if self.warmup_seconds > 0:
            return 0
        if self.warmup is not None:
            return self.warmup
        # the bucket starts empty and gains refill_ratio per success; thousandths avoid float rounding
        needed = -(-self.max_tokens * 1000 // max(1, round(self.refill_ratio * 1000)))
        return min(MAX_WARMUP, needed)

    def expected_seconds(self) -> float:
        """Rough length of the measured period, in seconds."""
        return self.messages / self.rate

    def warmup_schedule_publishes(self) -> int:
        """Publishes per publisher of a ``warmup_seconds`` warm-up (0 without one)."""
        return round(self.warmup_seconds * self.rate)

    def payload_bytes(self) -> int:
        """Bytes of data per message as published (the short payload is about 20 bytes)."""
        return max(self.message_size, 24)
