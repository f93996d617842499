"""Cloud Storage subscriptions, written to a local directory that stands for the buckets.

``gs://BUCKET/NAME`` is the file ``BUCKETS_DIR/BUCKET/NAME`` (a missing bucket folder is created). One
:class:`CloudStorageWriter` per Cloud Storage subscription leases its messages (the same leases, ordering,
transforms and dead-letter policy as Pull) and appends them to the file it has open:

- **Text** (``text_config``): each message's data followed by a newline.
- **Avro** (``avro_config``): one record per message with ``data`` (bytes); with ``write_metadata`` also
  ``subscription_name``, ``message_id``, ``publish_time`` (microseconds since the epoch) and
  ``attributes`` (a map of strings).

A file is closed once it holds ``max_messages`` messages or ``max_bytes`` bytes of messages, or once
``max_duration`` passed since its first message (5 minutes by default). Its name is ``filename_prefix``,
the time of its first message in ``filename_datetime_format`` (default ``YYYY-MM-DDThh:mm:ssZ``, UTC), an
underscore and a random UUID, then ``filename_suffix``.

**Durability.** A file is written under a temporary name (in the bucket's ``.hedgepub-partial`` folder,
named by a digest of the subscription's full name, so that subscriptions of two projects with the same
ID never touch each other's files), then flushed, ``fsync``-ed and renamed to its final name, and the
folder is ``fsync``-ed; only then are its messages acknowledged. A server killed at any point loses no
acknowledged message: the messages of a file not yet renamed are still unacknowledged and are written
again after the restart (the partial file is removed), so a message may appear twice, never zero times.

**Memory.** A message written to the open file leaves memory at once: its lease ends in memory only
(:meth:`~.delivery.SubscriptionState.acknowledge`), the store still holds it unacknowledged, and the file
keeps only its sequence number (8 bytes) until the file is durable and the sequences are acknowledged in
the store. So the subscription holds its window of ready messages and one batch being written, whatever
``max_bytes`` says; a file is closed early once it holds :data:`MAX_FILE_MESSAGES` messages.

**Failures.** A write that fails (a full disk, a file system that refuses the name) drops the open file,
temporary name and all, and makes the subscription read its unacknowledged backlog again from the store
(:meth:`~.delivery.SubscriptionState.reset`), so the messages of the dropped file are written again; the
writer tries again every :data:`RETRY_SECONDS` until a file succeeds. The first failure of a run is
logged, the rest of the run is counted (``CloudStorageWriter.failures``), and a success after failures is
logged as resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import re
import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from hedgepub._clock import Clock
from hedgepub.server._pubsub.delivery import SubscriptionState
from hedgepub.server._pubsub.export_config import DEFAULT_DATETIME_FORMAT, DEFAULT_MAX_DURATION_SECONDS
from hedgepub.server._pubsub.leases import MAX_MESSAGES_PER_RESPONSE, Consumer
from hedgepub.server._pubsub.limits import ServiceError, seconds

__all__ = ["AVRO_SCHEMA", "CloudStorageWriter", "ExportDispatcher", "ExportHost", "file_name"]

logger = logging.getLogger("hedgepub.server")

#: The folder of a bucket that holds files being written (hidden, so listings of the bucket skip it).
PARTIAL_FOLDER = ".hedgepub-partial"
#: Leases of messages in an open file last this much longer than the file may stay open.
LEASE_MARGIN_SECONDS = 60.0
#: Most messages one file holds (their sequence numbers are kept until it is durable: 8 MB at most).
MAX_FILE_MESSAGES = 1_000_000
#: Seconds between attempts after a failed write.
RETRY_SECONDS = 1.0

AVRO_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "PubsubMessage",
    "fields": [
        {"name": "subscription_name", "type": "string"},
        {"name": "message_id", "type": "string"},
        {"name": "publish_time", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "attributes", "type": {"type": "map", "values": "string"}},
        {"name": "data", "type": "bytes"},
    ],
}
_AVRO_DATA_ONLY: dict[str, Any] = {
    "type": "record",
    "name": "PubsubMessage",
    "fields": [{"name": "data", "type": "bytes"}],
}

_DATETIME_FIELD = re.compile(r"YYYY|MM|DD|hh|mm|ss")
_STRFTIME = {"YYYY": "%Y", "MM": "%m", "DD": "%d", "hh": "%H", "mm": "%M", "ss": "%S"}


class ExportHost(Protocol):
    """What a writer needs from the core."""

    def export_state(self, subscription: str) -> SubscriptionState | None:
        """The delivery state while it is a live Cloud Storage subscription, else ``None``."""

    async def lease(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease up to ``max_messages`` ready messages to ``consumer`` (``ReceivedMessage`` list)."""

    async def acknowledge_released(self, state: SubscriptionState, sequences: Sequence[int]) -> None:
        """Acknowledge in the store messages ``state`` let go of in memory (ServiceError once it is gone)."""


def partial_prefix(subscription: str) -> str:
    """What the temporary files of ``subscription`` (a full name) start with: a digest of the name, so
    that it is unique across projects and short (a subscription ID may be 255 characters, a file name's
    longest)."""
    return hashlib.sha256(subscription.encode()).hexdigest()[:32]


def file_name(storage: Any, when: datetime.datetime, unique: str) -> str:
    """The object name of a file begun at ``when`` (UTC) under ``storage`` (a ``CloudStorageConfig``)."""
    pattern = storage.filename_datetime_format or DEFAULT_DATETIME_FORMAT
    stamp = _DATETIME_FIELD.sub(lambda match: when.strftime(_STRFTIME[match.group(0)]), pattern)
    return f"{storage.filename_prefix}{stamp}_{unique}{storage.filename_suffix}"


class _OpenFile:
    """The file a writer is filling: its temporary path, what it holds, and the leases to acknowledge."""

    def __init__(self, bucket: Path, config: Any, opened: float, now_utc: datetime.datetime):
        self.unique = uuid.uuid4().hex
        partial = bucket / PARTIAL_FOLDER
        partial.mkdir(parents=True, exist_ok=True)
        self.temporary = partial / f"{partial_prefix(config.name)}-{self.unique}"
        self.final = bucket / file_name(config.cloud_storage_config, now_utc, self.unique)
        if not self.final.resolve().is_relative_to(bucket.resolve()):  # the checks at create forbid it
            raise ValueError(f"file name {self.final} is outside its bucket {bucket}")
        self.opened = opened
        #: Sequences of the messages written, to acknowledge in the store once the file is durable.
        self.sequences = array("q")
        self.bytes = 0
        self._stream: IO[bytes] = open(self.temporary, "wb")  # noqa: SIM115 (closed in finish/abandon)
        storage = config.cloud_storage_config
        self._avro: Any = None
        self._subscription = config.name
        self._metadata = storage.avro_config.write_metadata
        if storage.HasField("avro_config"):
            import fastavro

            schema = fastavro.parse_schema(AVRO_SCHEMA if self._metadata else _AVRO_DATA_ONLY)
            self._avro = fastavro.write.Writer(self._stream, schema)

    def write(self, received: Any, sequence: int) -> None:
        """Append one delivered message (``ReceivedMessage``), the message of store sequence ``sequence``."""
        message = received.message
        data = bytes(message.data)
        if self._avro is None:
            self._stream.write(data + b"\n")
            self.bytes += len(data) + 1
        else:
            record: dict[str, Any] = {"data": data}
            if self._metadata:
                publish = message.publish_time
                record.update(
                    subscription_name=self._subscription,
                    message_id=message.message_id,
                    publish_time=publish.seconds * 1_000_000 + publish.nanos // 1000,
                    attributes=dict(message.attributes),
                )
            self._avro.write(record)
            self.bytes += len(data)
        self.sequences.append(sequence)

    def finish(self) -> None:
        """Make the file durable under its final name (blocking: run in a thread)."""
        if self._avro is not None:
            self._avro.flush()
        self._stream.flush()
        os.fsync(self._stream.fileno())
        self._stream.close()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.temporary, self.final)
        for folder in {self.final.parent, self.temporary.parent}:
            descriptor = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

    def abandon(self) -> None:
        """Drop the file, temporary name and all; never raises (it runs after a failed write)."""
        # Closing flushes what the buffer holds, which fails again on a full disk; the descriptor is
        # closed all the same.
        with contextlib.suppress(OSError, ValueError):
            self._stream.close()
        with contextlib.suppress(OSError):
            self.temporary.unlink()


class CloudStorageWriter:
    """Writes one Cloud Storage subscription's messages to files until stopped."""

    def __init__(self, host: ExportHost, subscription: str, buckets_dir: Path, clock: Clock) -> None:
        self.host = host
        self.subscription = subscription
        self.buckets_dir = buckets_dir
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._file: _OpenFile | None = None
        #: The delivery state the messages of the open file came from.
        self._state: SubscriptionState | None = None
        #: Files written and messages acknowledged so far.
        self.files = 0
        self.written = 0
        #: Attempts that failed (a full disk, say), and those of the current run of failures.
        self.failures = 0
        self._failing = 0

    def start(self) -> None:
        """Start the loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop; a file not yet finished is dropped (its messages stay unacknowledged, and a subscription
        that lives on, as a pull subscription say, reads them again)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._drop_file()

    def _drop_file(self) -> None:
        """Drop the open file, if any, and have its messages delivered again."""
        current, self._file = self._file, None
        if current is None:
            return
        current.abandon()
        state = self._state
        if current.sequences and state is not None and not state.deleted and not state.config.detached:
            state.reset()  # they left memory when written: read the backlog again from the store

    def _bucket(self, config: Any) -> Path:
        return self.buckets_dir / config.cloud_storage_config.bucket

    def _remove_partial_files(self, config: Any) -> None:
        """Files a killed server left half written: their messages were never acknowledged."""
        partial = self._bucket(config) / PARTIAL_FOLDER
        if partial.is_dir():
            for path in partial.glob(f"{partial_prefix(config.name)}-*"):
                with contextlib.suppress(OSError):
                    path.unlink()

    async def _run(self) -> None:
        state = self.host.export_state(self.subscription)
        if state is None:
            return
        self._state = state
        consumer = Consumer(DEFAULT_MAX_DURATION_SECONDS + LEASE_MARGIN_SECONDS)
        cleaned = False
        while True:
            try:
                if not cleaned:
                    await asyncio.to_thread(self._remove_partial_files, state.config)
                    cleaned = True
                if not await self._step(consumer):
                    return
            except Exception as error:  # not CancelledError: stop() ends the loop
                self._failed(error)
                self._drop_file()
                # What the failed batch leased and did not write comes again now, not when its leases end.
                live = self.host.export_state(self.subscription)
                if live is state and state.leases:
                    state.reset()
                await self._clock.sleep(RETRY_SECONDS)

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        self._failing += 1
        if self._failing > 1:
            logger.debug("Writing %s to Cloud Storage files failed again: %s", self.subscription, error)
            return
        if isinstance(error, OSError):  # the disk's answer says it all
            logger.error(
                "Writing %s to Cloud Storage files failed: %s; the file is dropped, its messages stay "
                "unacknowledged, and the writer tries again every %g s.",
                self.subscription,
                error,
                RETRY_SECONDS,
            )
        else:
            logger.exception(
                "Writing %s to Cloud Storage files failed; retrying every %g s.",
                self.subscription,
                RETRY_SECONDS,
            )

    async def _step(self, consumer: Consumer) -> bool:
        state = self.host.export_state(self.subscription)
        if state is None:
            return False
        storage = state.config.cloud_storage_config
        max_duration = seconds(storage.max_duration) or DEFAULT_MAX_DURATION_SECONDS
        consumer.ack_deadline = max_duration + LEASE_MARGIN_SECONDS
        now = self._clock.now()
        current = self._file
        if current is not None and now - current.opened >= max_duration:
            await self._finish()
            return True
        batch = await self.host.lease(state, consumer, MAX_MESSAGES_PER_RESPONSE)
        if not batch:
            timeout = None if current is None else max(0.0, current.opened + max_duration - now)
            await state.wait_changed(timeout)
            return True
        max_messages = min(storage.max_messages or MAX_FILE_MESSAGES, MAX_FILE_MESSAGES)
        for received in batch:
            lease = state.leases.get(received.ack_id)
            if lease is None:
                continue  # taken back meanwhile (a Seek): it comes again
            if self._file is None:
                utc = datetime.datetime.now(datetime.UTC)
                self._file = await asyncio.to_thread(
                    _OpenFile, self._bucket(state.config), state.config, self._clock.now(), utc
                )
            self._file.write(received, lease.pending.sequence)
            # Out of memory now; the store keeps it unacknowledged until the file is durable.
            state.acknowledge((received.ack_id,))
            full = len(self._file.sequences) >= max_messages or (
                storage.max_bytes and self._file.bytes >= storage.max_bytes
            )
            if full:
                await self._finish()
        return True

    async def _finish(self) -> None:
        """Make the open file durable, then acknowledge its messages."""
        current = self._file
        state = self._state
        if current is None or state is None:
            return
        await asyncio.to_thread(current.finish)  # on failure the file stays open, for _run to drop
        self._file = None
        self.files += 1
        if self._failing:
            logger.warning(
                "Writing %s to Cloud Storage files resumed after %d failed attempts.",
                self.subscription,
                self._failing,
            )
            self._failing = 0
        try:
            await self.host.acknowledge_released(state, current.sequences)
        except ServiceError:  # deleted or detached meanwhile: the file stays, as the service's would
            return
        self.written += len(current.sequences)

    def __repr__(self) -> str:
        return (
            f"CloudStorageWriter({self.subscription!r}, files={self.files}, written={self.written}, "
            f"failures={self.failures})"
        )


class ExportDispatcher:
    """Starts and stops one :class:`CloudStorageWriter` per Cloud Storage subscription."""

    def __init__(self, host: ExportHost, clock: Clock, buckets_dir: str | os.PathLike[str] | None) -> None:
        self.host = host
        self._clock = clock
        self.buckets_dir = Path(buckets_dir) if buckets_dir is not None else None
        self.writers: dict[str, CloudStorageWriter] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, subscription: str) -> None:
        """Run a writer for ``subscription`` exactly while it is a live Cloud Storage subscription."""
        writer = self.writers.get(subscription)
        if self.buckets_dir is None or self.host.export_state(subscription) is None:
            if writer is not None:
                del self.writers[subscription]
                stopping = asyncio.ensure_future(writer.stop())
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
            return
        if writer is None:
            writer = CloudStorageWriter(self.host, subscription, self.buckets_dir, self._clock)
            self.writers[subscription] = writer
            writer.start()

    async def close(self) -> None:
        """Stop every writer."""
        writers, self.writers = list(self.writers.values()), {}
        await asyncio.gather(*(writer.stop() for writer in writers), *self._stopping, return_exceptions=True)
