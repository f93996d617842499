"""When the bench publishes: an open-loop arrival schedule, fixed before the run starts.

The schedule does not depend on how fast earlier publishes answer (an *open* loop), so a slow publish
never holds back the next one and slow publishes overlap, as they do for a real service under steady
load. A closed loop would hide the tail: a publisher stuck for 4 s would simply publish less.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

#: How arrivals are spaced: ``poisson`` (exponential gaps, as independent users make) or ``fixed``.
Arrivals = Literal["poisson", "fixed"]


def arrival_times(
    count: int, rate: float, *, seed: int | None = None, arrivals: Arrivals = "poisson"
) -> list[float]:
    """Return ``count`` arrival offsets in seconds from the start, in increasing order.

    ``rate`` is arrivals per second. The first arrival is at 0. With ``poisson`` the gaps are
    exponentially distributed with mean ``1 / rate`` (drawn from a generator seeded with ``seed``, so a
    run can be repeated); with ``fixed`` they are exactly ``1 / rate``.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0; got {count!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 arrivals per second; got {rate!r}")
    if arrivals == "fixed":
        return [index / rate for index in range(count)]
    if arrivals != "poisson":
        raise ValueError(f"arrivals must be 'poisson' or 'fixed'; got {arrivals!r}")
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def pair_orders(count: int, names: Sequence[str], *, seed: int | None = None) -> list[tuple[str, ...]]:
    """For each of ``count`` arrivals, the order in which the publishers ``names`` publish.

    Every publisher publishes at every arrival; the order within an arrival is shuffled so that neither
    publisher is always first to reach the event loop.
    """
    rng = random.Random(None if seed is None else seed + 1)
    orders = []
    for _ in range(count):
        order = list(names)
        rng.shuffle(order)
        orders.append(tuple(order))
    return orders
