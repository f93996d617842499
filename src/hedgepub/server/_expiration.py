"""Subscription expiration: a subscription inactive for its ``expiration_policy.ttl`` is deleted.

Activity, as the real service counts it, is a subscriber consuming or operating on the subscription:
here a Pull, an open StreamingPull stream (active for as long as it is open), an Acknowledge, a
ModifyAckDeadline, a Seek or an UpdateSubscription. Creating the subscription (or starting the server)
starts its clock. One timer per subscription runs on the injected clock; activity only records a time,
and the timer, when it fires, either deletes the subscription or sets itself for the new end of the ttl.
A subscription whose policy has no ttl never expires. The inactivity clock does not survive a restart:
it starts again when the server does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hedgepub._clock import Clock, TimerHandle
from hedgepub.server._limits import expiration_ttl

logger = logging.getLogger("hedgepub.server")


class _Watched:
    __slots__ = ("last_active", "streams", "timer", "ttl")

    def __init__(self, ttl: float, now: float) -> None:
        self.ttl = ttl
        self.last_active = now
        self.streams = 0
        self.timer: TimerHandle | None = None


class ExpirationWatch:
    """Keeps the inactivity deadline of every subscription and calls ``expire(name)`` when one passes."""

    def __init__(self, clock: Clock, expire: Callable[[str], None]) -> None:
        self._clock = clock
        self._expire = expire
        self._watched: dict[str, _Watched] = {}

    def watch(self, config: Any) -> None:
        """Start (or, after an update, restart) watching a subscription under its current policy."""
        name = config.name
        previous = self._watched.pop(name, None)
        if previous is not None and previous.timer is not None:
            previous.timer.cancel()
        ttl = expiration_ttl(config)
        if ttl is None:
            return
        watched = _Watched(ttl, self._clock.now())
        if previous is not None:
            watched.streams = previous.streams
        self._watched[name] = watched
        self._arm(name, watched, ttl)

    def _arm(self, name: str, watched: _Watched, delay: float) -> None:
        watched.timer = self._clock.call_later(delay, lambda: self._check(name, watched))

    def _check(self, name: str, watched: _Watched) -> None:
        if self._watched.get(name) is not watched:
            return  # forgotten or re-watched meanwhile
        now = self._clock.now()
        if watched.streams:
            watched.last_active = now
        remaining = watched.last_active + watched.ttl - now
        if remaining > 0:
            self._arm(name, watched, remaining)
            return
        del self._watched[name]
        logger.info(
            "Subscription %s was inactive for %gs (its expiration ttl): deleting it.", name, watched.ttl
        )
        self._expire(name)

    def touch(self, name: str) -> None:
        """The subscription was used now."""
        watched = self._watched.get(name)
        if watched is not None:
            watched.last_active = self._clock.now()

    def stream_opened(self, name: str) -> None:
        """A StreamingPull stream opened: the subscription is active until it closes."""
        watched = self._watched.get(name)
        if watched is not None:
            watched.streams += 1
            watched.last_active = self._clock.now()

    def stream_closed(self, name: str) -> None:
        """A StreamingPull stream closed; the ttl runs from now."""
        watched = self._watched.get(name)
        if watched is not None and watched.streams:
            watched.streams -= 1
            watched.last_active = self._clock.now()

    def forget(self, name: str) -> None:
        """The subscription is gone."""
        watched = self._watched.pop(name, None)
        if watched is not None and watched.timer is not None:
            watched.timer.cancel()

    def close(self) -> None:
        """Stop every timer."""
        for name in list(self._watched):
            self.forget(name)
