"""``publish_many``'s way into batches: :class:`CoreBulk`, the part of
:class:`~hedgepub._publisher.core._PublisherCore` that puts a call's checked messages into the publishing
thread's open batches in runs, as many at once as fit each batch, with one list entry
(:data:`~hedgepub._publisher.futures.BULK`) and no future per message.

The messages are checked by :meth:`~hedgepub._publisher.messages.MessagePreparer.prepare_many`; each run is
noted in its batch's segments, which resolve the call's :class:`~hedgepub._publisher.futures.ManyResult`
when the batch resolves. Batches fill, seal and go to the loop as ``publish`` fills them, through the
core's own methods (listed under ``TYPE_CHECKING`` on :class:`CoreBulk`).
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

from hedgepub._publisher.batch import Batch, BatchState
from hedgepub._publisher.flow_control import FlowController
from hedgepub._publisher.futures import BULK, ManyResult
from hedgepub._publisher.messages import ManyMessages, MessagePreparer

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry

__all__ = ["CoreBulk"]


class CoreBulk:
    """``publish_many`` in runs (a base class of ``_PublisherCore``, which sets every attribute below in its
    constructor and provides the methods named under TYPE_CHECKING)."""

    flow: FlowController
    telemetry: PublisherTelemetry | None
    _messages: MessagePreparer
    _max_messages: int
    _max_bytes: int
    _open: dict[tuple[Any, ...], Batch]

    if TYPE_CHECKING:

        def _fresh_own(
            self, topic: str, key: tuple[Any, ...], first: tuple[bytes, Any, int, int] | None = None
        ) -> tuple[Batch, Any]: ...

        def _seal_held(self, batch: Batch) -> None: ...

        def _wakeup_needed(self) -> bool: ...

        def _wake_loop(self) -> None: ...

    def prepare_many(self, topic: str, messages: Any, ordering_key: str) -> ManyMessages:
        """Check the messages of one ``publish_many`` call (see
        :meth:`~hedgepub._publisher.messages.MessagePreparer.prepare_many`)."""
        return self._messages.prepare_many(topic, messages, ordering_key)

    def bulk_ok(self) -> bool:
        """Whether ``publish_many`` may put its messages into batches in runs (:meth:`add_many`): no flow
        control (which admits message by message) and no OpenTelemetry (a span per message)."""
        return not self.flow.enabled and self.telemetry is None

    def add_many(self, topic: str, many: ManyMessages, result: ManyResult) -> None:
        """Put the checked messages of one ``publish_many`` call (none with an ordering key) into this
        thread's open batches, in runs: as many as fit each batch at once, under its lock, one list entry
        (:data:`~hedgepub._publisher.futures.BULK`) and no future per message; every run is noted in its
        batch's segments, which resolve ``result``. Batches fill, seal and go to the loop as ``publish``
        fills them. If the publisher stops accepting messages midway, the rest fail in ``result`` with
        the refusal (the ones already in batches are published)."""
        payloads, framed, messages = many.payloads, many.framed, many.messages
        count = len(payloads)
        # One framed size for all (same), or each message's (sizes).
        same, sizes = (framed, ()) if isinstance(framed, int) else (0, framed)
        max_messages, max_bytes = self._max_messages, self._max_bytes
        key = (topic, "", threading.get_ident())
        index = 0
        while index < count:
            batch = self._open.get(key)
            if batch is None or batch.state is not BatchState.OPEN:
                try:
                    batch, _ = self._fresh_own(topic, key)
                except RuntimeError as refused:
                    result.failed(index, count - index, refused)
                    return
            with batch.lock:
                if batch.state is not BatchState.OPEN:
                    continue
                room = max_messages - len(batch.futures)
                if same:
                    taking = min(room, (max_bytes - batch.byte_size) // same, count - index)
                    added = taking * same
                else:
                    taking, added, left = 0, 0, max_bytes - batch.byte_size
                    limit = min(room, count - index)
                    while taking < limit and added + sizes[index + taking] <= left:
                        added += sizes[index + taking]
                        taking += 1
                if taking <= 0 and not batch.futures:  # larger than max_bytes: alone, as publish sends it
                    taking, added = 1, same or sizes[index]
                if taking > 0:
                    end = index + taking
                    if messages is None:
                        batch.plain += payloads[index:end]
                    else:
                        for position in range(index, end):
                            message = messages[position]
                            if message is None:
                                batch.add_data(payloads[position])
                            else:
                                batch.add_message(message)
                    batch.byte_size += added
                    futures = batch.futures
                    segment = (result, len(futures), taking, index)
                    if batch.segments is None:
                        batch.segments = [segment]
                    else:
                        batch.segments.append(segment)
                    futures += itertools.repeat(BULK, taking)
                    index = end
                if taking <= 0 or len(batch.futures) >= max_messages or batch.byte_size >= max_bytes:
                    self._seal_held(batch)
                    sealed = True
                else:
                    sealed = False
            if sealed and self._wakeup_needed():
                self._wake_loop()
