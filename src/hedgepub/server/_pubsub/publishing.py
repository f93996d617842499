"""Publishing: check a Publish request, apply its topic's message transforms, stamp it against the
topic's schema, number its messages, make them durable and fan them out to the topic's subscriptions.

The transforms run first, so that the schema validates what is stored (a decompressing transform then
lets compressed data be published to a topic with a schema).

A published message is appended to every subscription attached to its topic ("fan-out") only after the
store has made it durable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.delivery import SubscriptionState
from hedgepub.server._pubsub.registry import Registry
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.schemas import SchemaRegistry
from hedgepub.server._pubsub.transforms import NotRun, TransformFailed, Transforms
from hedgepub.server._store.batch import Batch
from hedgepub.server._store.protocol import Store

__all__ = ["Publishing"]


def _transformed(results: list[Any]) -> tuple[list[Any], list[int]]:
    """A topic's transforms' results on each message of a Publish request: the messages to store and the
    positions of those filtered out. A failure fails the whole request (INVALID_ARGUMENT, naming the
    message and the transform), as nothing of it is stored; so does a message whose transforms did not
    run (the request's CPU budget was spent on the messages before it)."""
    kept: list[Any] = []
    filtered: list[int] = []
    for index, transformed in enumerate(results):
        if isinstance(transformed, TransformFailed):
            raise limits.invalid(
                f"The topic's message transforms failed on message {index} of the request: {transformed}"
            )
        if isinstance(transformed, NotRun):
            raise limits.invalid(
                f"The topic's message transforms did not run on message {index} of the request: "
                f"{transformed}. Publish fewer messages per request."
            )
        if transformed is None:
            filtered.append(index)
        else:
            kept.append(transformed)
    return kept, filtered


class Publishing:
    """Publish and the appending of accepted messages to the subscriptions the registry attaches to their
    topic (the registry's tables are read here, changed by the catalog)."""

    def __init__(
        self,
        store: Store,
        wall_clock_ns: Callable[[], int],
        registry: Registry,
        *,
        schemas: SchemaRegistry,
        replay: Replay,
        transforms: Transforms,
    ) -> None:
        self._store = store
        self._transforms = transforms
        self._wall_clock_ns = wall_clock_ns
        # The registry's tables themselves (changed in place, never replaced): read on every Publish.
        self._topics: Mapping[str, Any] = registry.topics
        self._attached: Mapping[str, Mapping[str, SubscriptionState]] = registry.attached
        self._schemas = schemas
        self._replay = replay
        #: The sequence number (and message ID) of the next message stored, on any topic.
        self.next_sequence = 1

    async def publish(
        self, topic_name: str, messages: Any, request_bytes: int, request: Any = None
    ) -> list[str]:
        """Publish: validate, number, make durable, fan out; return the message IDs.

        ``request``, when given, is the ``PublishRequest`` whose ``messages`` these are: stored as it is
        when every message is kept unchanged (see :class:`Batch`).
        """
        if topic_name not in self._topics:
            # Raises INVALID_ARGUMENT or NOT_FOUND.
            resources.existing(self._topics, limits.check_topic_name(topic_name))
        resources.check_publish(messages, request_bytes, request)
        topic = self._topics[topic_name]
        kept: Any = messages
        filtered: list[int] = []
        transforms = topic.message_transforms
        if transforms and not all(transform.disabled for transform in transforms):
            kept, filtered = _transformed(await self._transforms.apply(topic_name, transforms, messages))
            request = None  # the messages stored are the transforms' results
        if topic.HasField("schema_settings") and kept:
            await self._schemas.stamp_messages(topic_name, topic.schema_settings, kept)
        if not filtered:
            return await self.append(topic_name, kept, request)
        # A filtered message gets an ID (the publisher learns nothing of the filter) and is not stored;
        # its IDs come first, so that a stored message's ID is above them.
        filtered_ids = [str(self.next_sequence + offset) for offset in range(len(filtered))]
        self.next_sequence += len(filtered)
        if not kept:
            # Nothing stored to carry the numbers past a restart: the store keeps them given out.
            await self._store.reserve(self.next_sequence - 1)
        kept_ids = iter(await self.append(topic_name, kept) if kept else [])
        from_filtered = iter(filtered_ids)
        dropped = set(filtered)
        return [next(from_filtered) if index in dropped else next(kept_ids) for index in range(len(messages))]

    async def append(self, topic_name: str, messages: Any, request: Any = None) -> list[str]:
        """Number, make durable and fan out messages already accepted (no request limits apply), as one
        :class:`Batch` (``request``: the ``PublishRequest`` that holds exactly these messages, if any)."""
        sequence = self.next_sequence
        batch = Batch(sequence, topic_name, self._wall_clock_ns(), messages, request)
        self.next_sequence = batch.end
        attached = self._attached.get(topic_name)
        targets = list(attached.values()) if attached else []
        holders = [state.name for state in targets] + self._replay.holders_for(topic_name)
        await self._store.append(batch, holders)
        for state in targets:
            if not state.deleted:
                refused = state.add(batch)
                if refused:
                    await self._store.ack(state.name, refused)
        return batch.ids()
