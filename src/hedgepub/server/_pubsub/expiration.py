"""Subscription expiration: a subscription inactive for its ``expiration_policy.ttl`` is deleted.

Activity, as the real service counts it, is a subscriber consuming or operating on the subscription: here
a Pull, an open StreamingPull stream (active for as long as it is open), an Acknowledge, a
ModifyAckDeadline, a Seek or an UpdateSubscription. Creating the subscription starts its clock (and so
does starting the server, for a subscription with no recorded activity, from a data directory written
before activity was recorded). One timer per subscription runs on the injected clock; activity only
records a time, and the timer, when it fires, either deletes the subscription or sets itself for the new
end of the ttl. A subscription whose policy has no ttl never expires.

The inactivity clock survives a restart, coarsely: activity goes to the host's ``record_activity`` (which
the core writes to the store with the calendar time) when the subscription's last record is
:data:`RECORD_EVERY` old or more, and every :data:`RECORD_EVERY` while a StreamingPull stream is open. So
the last activity is less than that after the recorded one, and after a restart the clock goes on from
the recorded time plus that bound: a subscription may expire up to a minute later than without the
restart, never earlier. A minute is nothing next to a ttl of at least a day (under 0.07%), and a
subscriber that pulls all the time costs one small write a minute instead of one per call.

A record is durable before the answer that depends on it: :meth:`ExpirationWatch.touch` returns what the
host's ``record_activity`` returned (an awaitable that ends once the record is written, or ``None`` when
nothing was due), and a Pull, Acknowledge or Seek awaits it before it answers, so a server killed just
after answering cannot come back with an older record and expire the subscription early.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from hedgepub._clock import Clock, TimerHandle
from hedgepub.server._pubsub.limits import expiration_ttl

logger = logging.getLogger("hedgepub.server")

#: Seconds between two records of one subscription's activity, at least (and the period of the records
#: of subscriptions with an open stream).
RECORD_EVERY = 60.0


class _Watched:
    __slots__ = ("last_active", "recorded", "streams", "timer", "ttl")

    def __init__(self, ttl: float, last_active: float) -> None:
        self.ttl = ttl
        self.last_active = last_active
        #: when (on the clock) the activity last handed to the record hook happened
        self.recorded = float("-inf")
        self.streams = 0
        self.timer: TimerHandle | None = None


class ExpirationHost(Protocol):
    """What the watch calls into: the composition root (:class:`.core.PubSubCore`), which holds both the
    catalog that deletes subscriptions and the store the activity is written to (the catalog itself
    depends on the watch, so it cannot be handed to it)."""

    def expire_subscription(self, name: str) -> None:
        """The subscription was inactive for its ttl: delete it."""

    def record_activity(self, name: str) -> Awaitable[None] | None:
        """Store that ``name`` is active now; an awaitable that ends once it is written, or ``None``."""


class ExpirationWatch:
    """Keeps the inactivity deadline of every subscription and has its ``host`` expire one whose deadline
    passes, and record a subscription's activity when it should be stored (see the module's docstring
    for when)."""

    def __init__(self, clock: Clock, host: ExpirationHost) -> None:
        self._clock = clock
        self._host = host
        self._watched: dict[str, _Watched] = {}
        #: subscriptions with an open stream, recorded as active every RECORD_EVERY by one timer
        self._streaming: set[str] = set()
        self._ticker: TimerHandle | None = None

    def watch(self, config: Any, idle: float | None = None) -> None:
        """Start (or, after an update, restart) watching a subscription under its current policy.

        ``idle``: seconds the subscription has been inactive, as recorded before a restart (the server
        loading it); ``None``: it is active now (created or updated), which is recorded.
        """
        name = config.name
        previous = self._watched.pop(name, None)
        if previous is not None and previous.timer is not None:
            previous.timer.cancel()
        ttl = expiration_ttl(config)
        if ttl is None:
            return
        now = self._clock.now()
        watched = _Watched(ttl, now - (idle or 0.0))
        if previous is not None:
            watched.streams = previous.streams
            watched.recorded = previous.recorded
        self._watched[name] = watched
        if idle is None:
            self._active(name, watched, now)
        self._arm(name, watched, watched.last_active + ttl - now)

    def _active(
        self, name: str, watched: _Watched, now: float, *, record: bool = False
    ) -> Awaitable[None] | None:
        """The subscription is active at ``now``: remember it, and have it recorded if it is time to (or
        ``record``); what the host's record_activity returned (awaitable until it is written), else None."""
        watched.last_active = now
        if record or now - watched.recorded >= RECORD_EVERY:
            watched.recorded = now
            return self._host.record_activity(name)
        return None

    def _arm(self, name: str, watched: _Watched, delay: float) -> None:
        watched.timer = self._clock.call_later(delay, lambda: self._check(name, watched))

    def _check(self, name: str, watched: _Watched) -> None:
        if self._watched.get(name) is not watched:
            return  # forgotten or re-watched meanwhile
        now = self._clock.now()
        if watched.streams:
            self._active(name, watched, now)
        remaining = watched.last_active + watched.ttl - now
        if remaining > 0:
            self._arm(name, watched, remaining)
            return
        del self._watched[name]
        logger.info(
            "Subscription %s was inactive for %gs (its expiration ttl): deleting it.", name, watched.ttl
        )
        self._host.expire_subscription(name)

    def touch(self, name: str) -> Awaitable[None] | None:
        """The subscription was used now. Returns an awaitable when that is being recorded (await it
        before answering the call), else None."""
        watched = self._watched.get(name)
        if watched is not None:
            return self._active(name, watched, self._clock.now())
        return None

    def stream_opened(self, name: str) -> None:
        """A StreamingPull stream opened: the subscription is active until it closes."""
        watched = self._watched.get(name)
        if watched is not None:
            watched.streams += 1
            self._active(name, watched, self._clock.now())
            self._streaming.add(name)
            if self._ticker is None:
                self._ticker = self._clock.call_later(RECORD_EVERY, self._tick)

    def stream_closed(self, name: str) -> None:
        """A StreamingPull stream closed; the ttl runs from now."""
        watched = self._watched.get(name)
        if watched is not None and watched.streams:
            watched.streams -= 1
            self._active(name, watched, self._clock.now())
            if not watched.streams:
                self._streaming.discard(name)

    def _tick(self) -> None:
        """Timer: subscriptions with an open stream are active now (so a restart knows they were)."""
        self._ticker = None
        now = self._clock.now()
        for name in list(self._streaming):
            watched = self._watched.get(name)
            if watched is None or not watched.streams:
                self._streaming.discard(name)
            else:
                # Every tick, however recent the last record: the stream keeps it active until now.
                self._active(name, watched, now, record=True)
        if self._streaming:
            self._ticker = self._clock.call_later(RECORD_EVERY, self._tick)

    def forget(self, name: str) -> None:
        """The subscription is gone."""
        self._streaming.discard(name)
        watched = self._watched.pop(name, None)
        if watched is not None and watched.timer is not None:
            watched.timer.cancel()

    def close(self) -> None:
        """Stop every timer."""
        for name in list(self._watched):
            self.forget(name)
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
