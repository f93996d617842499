"""What the parts of the Pub/Sub core share: the registry of topics and subscriptions, and background work.

:class:`Registry` holds the one table of topics, the one table of subscriptions (their delivery states)
and, per topic, the subscriptions attached to it. The catalog (:mod:`.catalog`) changes them, through the
methods here; publishing, consumers and replay look resources up and read the tables (the tables are
changed in place, never replaced, so a part may keep a reference to one on its hot path).
:class:`Background` runs the coroutines the parts start and do not await, and ends them when the core
closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub.resources import existing

if TYPE_CHECKING:
    from hedgepub.server._pubsub.delivery import SubscriptionState


class Registry:
    """The topics, the subscriptions and which subscriptions each topic feeds."""

    __slots__ = ("attached", "subscriptions", "topics")

    def __init__(self) -> None:
        #: Topic name -> its ``Topic``.
        self.topics: dict[str, Any] = {}
        #: Subscription name -> its delivery state (whose ``config`` is the ``Subscription``).
        self.subscriptions: dict[str, SubscriptionState] = {}
        #: Topic name -> the delivery states of the subscriptions attached to it, by name.
        self.attached: dict[str, dict[str, SubscriptionState]] = {}

    def topic(self, name: str) -> Any:
        """The topic ``name``: INVALID_ARGUMENT for a malformed name, NOT_FOUND for an unknown one."""
        return existing(self.topics, limits.check_topic_name(name))

    def subscription(self, name: str) -> SubscriptionState:
        """The delivery state of subscription ``name`` (INVALID_ARGUMENT, NOT_FOUND as :meth:`topic`)."""
        return existing(self.subscriptions, limits.check_subscription_name(name))

    def states(self) -> list[SubscriptionState]:
        """Every subscription's delivery state (a list: the table may change while it is walked)."""
        return list(self.subscriptions.values())

    def add_topic(self, topic: Any) -> None:
        """Register a new or updated topic (a new one starts with no subscription attached)."""
        self.topics[topic.name] = topic
        self.attached.setdefault(topic.name, {})

    def remove_topic(self, name: str) -> list[SubscriptionState]:
        """Forget a topic; return the states of the subscriptions that were attached to it."""
        self.topics.pop(name, None)
        return list(self.attached.pop(name, {}).values())

    def add_subscription(self, state: SubscriptionState, attach: bool = True) -> None:
        """Register a subscription, attached to its topic (if ``attach`` and the topic exists)."""
        name = state.config.name
        self.subscriptions[name] = state
        if attach and state.config.topic in self.topics:
            self.attached.setdefault(state.config.topic, {})[name] = state

    def detach(self, state: SubscriptionState) -> None:
        """Its topic no longer feeds the subscription."""
        self.attached.get(state.config.topic, {}).pop(state.config.name, None)

    def remove_subscription(self, state: SubscriptionState) -> bool:
        """Forget a subscription (detaching it); whether ``state`` was the registered one."""
        name = state.config.name
        if self.subscriptions.get(name) is not state:
            return False
        del self.subscriptions[name]
        self.detach(state)
        return True

    def topic_of_subscription(self, name: str) -> str | None:
        """The topic an existing subscription receives from, if that topic exists; ``None`` otherwise."""
        state = self.subscriptions.get(name)
        if state is None or state.config.topic not in self.topics:
            return None
        topic: str = state.config.topic
        return topic

    def clear(self) -> None:
        """Forget every topic and subscription."""
        self.topics.clear()
        self.subscriptions.clear()
        self.attached.clear()


class Background:
    """Coroutines the core's parts start and do not await (store writes, deletions, forwarding)."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Run ``coroutine`` as a task of its own on the running loop."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        """Cancel what still runs and wait until it has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
