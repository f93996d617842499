"""Any client's hedges, as the ``x-goog-pubsub-client-telemetry`` header of their Publish calls tells them.

Google's Java, Go and Rust clients (and hedgepub's publisher) send on each Publish attempt the standard
base64 of a serialized ``google.pubsub.v1.PubsubClientTelemetry``: ``hedged_attempt_count`` (0 for the
original and its retries, k for hedge k) and ``publish_start_time`` (when the batch was first sent, the
same on all its attempts); :mod:`hedgepub._wire` decodes it. The gRPC face reads it here on every
Publish: :class:`HedgeTelemetry` counts the publishes, those that carry the header and the hedges among
them (``LocalServer.hedge_telemetry.counts``), and gives ``--dedup-hedges`` the key that tells the
attempts of one batch apart from an unrelated publish (:func:`telemetry_batch_key`). A header that cannot
be read is ignored, and said once in the log: it never fails a publish.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry, telemetry_class

__all__ = ["Attempt", "HedgeTelemetry", "HedgeTelemetryCounts", "attempt_of", "telemetry_batch_key"]

logger = logging.getLogger("hedgepub.server")


@dataclass(frozen=True)
class Attempt:
    """What one Publish call's header says."""

    #: 0 for the original attempt (and its retries), k for hedge k.
    number: int
    #: When its batch was first sent, in nanoseconds since the Unix epoch; ``None`` when not given.
    start_ns: int | None


@dataclass(frozen=True)
class HedgeTelemetryCounts:
    """Publish calls as their ``x-goog-pubsub-client-telemetry`` header describes them (a snapshot)."""

    #: Publish calls received (with a parsable request and, under IAM enforcement, allowed).
    publishes: int = 0
    #: Of those, the ones whose header could be read.
    with_telemetry: int = 0
    #: Of those, hedges (``hedged_attempt_count`` of 1 or more).
    hedges: int = 0
    #: Publish calls whose header could not be read (ignored; the publish is served as usual).
    malformed: int = 0


def attempt_of(metadata: Iterable[tuple[str, Any]] | None) -> Attempt | None:
    """The attempt a call's metadata describes (``None`` without the header); ValueError if malformed."""
    for key, value in metadata or ():
        if key == CLIENT_TELEMETRY_KEY:
            number, start = decode_client_telemetry(value)  # checks it (ValueError)
            if start is None:
                return Attempt(number, None)
            # Exact nanoseconds, not the float seconds: two batches may start within a microsecond.
            stamp = telemetry_class().FromString(base64.b64decode(value)).publish_operation.publish_start_time
            return Attempt(number, stamp.seconds * 1_000_000_000 + stamp.nanos)
    return None


def telemetry_batch_key(attempt: Attempt, messages: Any) -> str | None:
    """``--dedup-hedges``: the key all attempts of one batch share, when the header lets them be told
    apart from an unrelated publish: the batch's start time and a digest of its messages (their data,
    attributes and ordering keys, as serialized). ``None`` without a start time."""
    if attempt.start_ns is None:
        return None
    digest = hashlib.sha256()
    for message in messages:
        body = message.SerializeToString(deterministic=True)  # attributes (a map) in one order
        digest.update(len(body).to_bytes(8, "big"))
        digest.update(body)
    return f"telemetry:{attempt.start_ns}:{digest.hexdigest()}"


class HedgeTelemetry:
    """Reads each Publish call's header and counts what it says; one event loop."""

    def __init__(self) -> None:
        self._publishes = 0
        self._with_telemetry = 0
        self._hedges = 0
        self._malformed = 0

    @property
    def counts(self) -> HedgeTelemetryCounts:
        """A snapshot of the counters."""
        return HedgeTelemetryCounts(self._publishes, self._with_telemetry, self._hedges, self._malformed)

    def read(
        self, metadata: Iterable[tuple[str, Any]] | None, peer: Callable[[], str] | None = None
    ) -> Attempt | None:
        """Count one Publish call; return what its header says (``None``: no header, or unreadable).
        ``peer()`` names the caller in the log line about a malformed header."""
        self._publishes += 1
        try:
            attempt = attempt_of(metadata)
        except ValueError as error:
            self._malformed += 1
            if self._malformed == 1:  # once: a client that sends a bad header sends it on every call
                logger.warning(
                    "ignoring a malformed %s header (peer %s): %s; publishes that carry one are served as "
                    "usual, counted, and not logged again",
                    CLIENT_TELEMETRY_KEY,
                    peer() if peer is not None else "unknown",
                    error,
                )
            return None
        if attempt is not None:
            self._with_telemetry += 1
            if attempt.number:
                self._hedges += 1
        return attempt

    def __repr__(self) -> str:
        counts = self.counts
        return (
            f"<HedgeTelemetry {counts.publishes} publishes, {counts.with_telemetry} with telemetry, "
            f"{counts.hedges} hedges, {counts.malformed} malformed>"
        )
