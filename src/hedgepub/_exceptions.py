"""The exceptions hedgepub raises, and sets on publish futures.

::

    HedgepubError
    ├── PublishError                  a batch (and every message future in it) failed
    │   ├── RpcError                  the server answered with a status code (``.code``)
    │   ├── PublishTimeoutError       the total timeout passed; ``.last_error`` is the last attempt's
    │   ├── ResponseMismatchError     the server returned a different number of message IDs than sent
    │   ├── OrderingKeyPausedError    the ordering key failed earlier; call ``resume_publish``
    │   └── ShutdownTimeoutError      ``shutdown(timeout)`` ended before the message was published
    └── FlowControlLimitError         flow control refused the message (``LimitExceededBehavior.ERROR``)

Every ``PublishError`` carries ``code`` (a :class:`StatusCode` or ``None``) so that callers can tell a
permanent error (``NOT_FOUND``, ``PERMISSION_DENIED``) from a transient one without importing gRPC.
"""

from __future__ import annotations

from hedgepub._status import StatusCode


class HedgepubError(Exception):
    """Base class of every exception hedgepub raises on purpose."""


class PublishError(HedgepubError):
    """A publish failed; every message of the failed batch gets the same error."""

    code: StatusCode | None = None


class RpcError(PublishError):
    """The server (or the channel) answered an attempt with a non-OK status code."""

    def __init__(self, code: StatusCode, message: str = "") -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.details = message

    def __repr__(self) -> str:
        return f"RpcError({self.code.name}, {self.details!r})"


class PublishTimeoutError(PublishError):
    """The batch's total timeout passed with no successful attempt."""

    code = StatusCode.DEADLINE_EXCEEDED

    def __init__(self, message: str, last_error: BaseException | None = None) -> None:
        super().__init__(message if last_error is None else f"{message}; last error: {last_error}")
        self.last_error = last_error


class ResponseMismatchError(PublishError):
    """The server returned a number of message IDs that differs from the number of messages sent."""

    code = StatusCode.INTERNAL


class OrderingKeyPausedError(PublishError):
    """Publishing on this ordering key is paused after a failure; ``resume_publish`` resumes it."""

    def __init__(self, ordering_key: str) -> None:
        super().__init__(
            f"publishing with ordering key {ordering_key!r} is paused after an earlier failure; "
            "call resume_publish(topic, ordering_key) to resume"
        )
        self.ordering_key = ordering_key


class ShutdownTimeoutError(PublishError):
    """``shutdown(timeout=...)`` ran out of time before this message was published."""

    code = StatusCode.CANCELLED


class FlowControlLimitError(HedgepubError):
    """Flow control is set to ``ERROR`` and the message would exceed a limit."""
