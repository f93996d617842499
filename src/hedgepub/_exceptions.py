"""The exceptions hedgepub raises, and sets on publish futures.

::

    HedgepubError
    ├── PublishError                  a batch (and every message future in it) failed
    │   ├── RpcError                  the server answered with a status code (``.code``); one subclass
    │   │                             per code, e.g. NotFound, also google.api_core.exceptions.NotFound
    │   ├── PublishTimeoutError       the total timeout passed; ``.last_error`` is the last attempt's;
    │   │                             also google.api_core.exceptions.DeadlineExceeded
    │   ├── ResponseMismatchError     the server returned a different number of message IDs than sent
    │   ├── OrderingKeyPausedError    the ordering key failed earlier; call ``resume_publish``
    │   └── ShutdownTimeoutError      ``shutdown(timeout)`` ended before the message was published
    └── FlowControlLimitError         flow control refused the message (``LimitExceededBehavior.ERROR``)

Every ``PublishError`` carries ``code`` (a :class:`StatusCode` or ``None``) so that callers can tell a
permanent error (``NOT_FOUND``, ``PERMISSION_DENIED``) from a transient one without importing gRPC.

Code written for the official client keeps working: every error for an RPC status is also the
``google.api_core.exceptions`` class of that status (``except NotFound``, ``except PermissionDenied``,
``except GoogleAPICallError`` catch hedgepub's errors as they catch the official client's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.api_core import exceptions as _google

from hedgepub._status import StatusCode


class HedgepubError(Exception):
    """Base class of every exception hedgepub raises on purpose."""


class PublishError(HedgepubError):
    """A publish failed; every message of the failed batch gets the same error."""

    code: StatusCode | None = None


class RpcError(PublishError, _google.GoogleAPICallError):
    """The server (or the channel) answered an attempt with a non-OK status code.

    Each one is also the ``google.api_core.exceptions`` class of its code, as the official client raises:
    ``RpcError(StatusCode.NOT_FOUND, ...)`` makes a :class:`NotFound`, which is a
    ``google.api_core.exceptions.NotFound`` (so a ``GoogleAPICallError``) as well as a ``hedgepub.RpcError``.

    Attributes: ``code`` (hedgepub's :class:`StatusCode`), ``grpc_status_code`` (``grpc.StatusCode``),
    ``message`` (the server's status message, also ``details`` as gRPC calls it), ``error_details`` (the
    ``google.rpc`` detail messages the status carried, e.g. ``ErrorInfo``; Google's ``reason``, ``domain``
    and ``metadata`` read its ``ErrorInfo``), ``response`` (the gRPC error, when it came from one).
    """

    code: StatusCode

    def __new__(cls, code: StatusCode, message: str = "", **_: Any) -> RpcError:
        if cls is RpcError:
            cls = _CLASS_BY_CODE.get(StatusCode(code), RpcError)
        return super().__new__(cls)

    def __init__(
        self,
        code: StatusCode,
        message: str = "",
        *,
        error_details: Sequence[Any] = (),
        error_info: Any = None,
        response: Any = None,
    ) -> None:
        errors = (response,) if response is not None else ()
        _google.GoogleAPICallError.__init__(self, message, errors, list(error_details), response, error_info)
        self.code = StatusCode(code)

    @property
    def details(self) -> str:
        """The status message (gRPC's ``details()``); the ``google.rpc`` details are ``error_details``."""
        return str(self.message)

    @property
    def error_details(self) -> list[Any]:
        """The ``google.rpc`` detail messages of the status (``ErrorInfo``, ``RetryInfo``, ...)."""
        return list(self._details)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.message else self.code.name

    def __repr__(self) -> str:
        return f"RpcError({self.code.name}, {self.message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from code and message (the gRPC call it came from does not cross processes).
        return (RpcError, (self.code, self.message), {"_details": list(self._details)})


class PublishTimeoutError(PublishError, _google.DeadlineExceeded):
    """The batch's total timeout passed with no successful attempt.

    Also a ``google.api_core.exceptions.DeadlineExceeded``, as the official client's timeout is.
    """

    code: StatusCode

    def __init__(self, message: str, last_error: BaseException | None = None) -> None:
        text = message if last_error is None else f"{message}; last error: {last_error}"
        _google.DeadlineExceeded.__init__(self, text)
        self.code = StatusCode.DEADLINE_EXCEEDED
        self.last_error = last_error

    def __str__(self) -> str:
        return str(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_timeout, (self.message, self.last_error))


def _rebuild_timeout(message: str, last_error: BaseException | None) -> PublishTimeoutError:
    error = PublishTimeoutError(message)
    error.last_error = last_error
    return error


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


class PublishManyError(PublishError):
    """Some messages of one ``publish_many`` call failed; the others were published.

    Attributes: ``message_ids``, one entry per message of the call in order: its message ID, or ``None``
    where it failed; ``errors``, the failed messages' indexes (in the call) mapped to their errors (each a
    :class:`PublishError`, as ``publish`` would have given). The message says how many failed, and the first.
    """

    def __init__(self, message_ids: list[str | None], errors: dict[int, BaseException]) -> None:
        first = min(errors)
        super().__init__(
            f"{len(errors)} of the {len(message_ids)} messages of publish_many failed; the first, "
            f"messages[{first}]: {errors[first]}"
        )
        self.message_ids = message_ids
        self.errors = errors
        self.code = getattr(errors[first], "code", None)


class FlowControlLimitError(HedgepubError):
    """Flow control is set to ``ERROR`` and the message would exceed a limit."""


#: The ``google.api_core.exceptions`` class of each status code, as ``exception_class_for_grpc_status``
#: maps them (a test checks that they agree).
GOOGLE_CLASS_BY_CODE: dict[StatusCode, type[_google.GoogleAPICallError]] = {
    StatusCode.CANCELLED: _google.Cancelled,
    StatusCode.UNKNOWN: _google.Unknown,
    StatusCode.INVALID_ARGUMENT: _google.InvalidArgument,
    StatusCode.DEADLINE_EXCEEDED: _google.DeadlineExceeded,
    StatusCode.NOT_FOUND: _google.NotFound,
    StatusCode.ALREADY_EXISTS: _google.AlreadyExists,
    StatusCode.PERMISSION_DENIED: _google.PermissionDenied,
    StatusCode.RESOURCE_EXHAUSTED: _google.ResourceExhausted,
    StatusCode.FAILED_PRECONDITION: _google.FailedPrecondition,
    StatusCode.ABORTED: _google.Aborted,
    StatusCode.OUT_OF_RANGE: _google.OutOfRange,
    StatusCode.UNIMPLEMENTED: _google.MethodNotImplemented,
    StatusCode.INTERNAL: _google.InternalServerError,
    StatusCode.UNAVAILABLE: _google.ServiceUnavailable,
    StatusCode.DATA_LOSS: _google.DataLoss,
    StatusCode.UNAUTHENTICATED: _google.Unauthenticated,
}


def _rpc_error_class(code: StatusCode, google_class: type[_google.GoogleAPICallError]) -> type[RpcError]:
    return type(
        google_class.__name__,
        (RpcError, google_class),
        {
            "__module__": __name__,
            "__doc__": f"An :class:`RpcError` with status ``{code.name}``; also a "
            f"``google.api_core.exceptions.{google_class.__name__}``.",
        },
    )


#: hedgepub's class of each status code: RpcError and Google's class of the code in one.
_CLASS_BY_CODE: dict[StatusCode, type[RpcError]] = {
    code: _rpc_error_class(code, google_class) for code, google_class in GOOGLE_CLASS_BY_CODE.items()
}
Cancelled = _CLASS_BY_CODE[StatusCode.CANCELLED]
Unknown = _CLASS_BY_CODE[StatusCode.UNKNOWN]
InvalidArgument = _CLASS_BY_CODE[StatusCode.INVALID_ARGUMENT]
DeadlineExceeded = _CLASS_BY_CODE[StatusCode.DEADLINE_EXCEEDED]
NotFound = _CLASS_BY_CODE[StatusCode.NOT_FOUND]
AlreadyExists = _CLASS_BY_CODE[StatusCode.ALREADY_EXISTS]
PermissionDenied = _CLASS_BY_CODE[StatusCode.PERMISSION_DENIED]
ResourceExhausted = _CLASS_BY_CODE[StatusCode.RESOURCE_EXHAUSTED]
FailedPrecondition = _CLASS_BY_CODE[StatusCode.FAILED_PRECONDITION]
Aborted = _CLASS_BY_CODE[StatusCode.ABORTED]
OutOfRange = _CLASS_BY_CODE[StatusCode.OUT_OF_RANGE]
MethodNotImplemented = _CLASS_BY_CODE[StatusCode.UNIMPLEMENTED]
InternalServerError = _CLASS_BY_CODE[StatusCode.INTERNAL]
ServiceUnavailable = _CLASS_BY_CODE[StatusCode.UNAVAILABLE]
DataLoss = _CLASS_BY_CODE[StatusCode.DATA_LOSS]
Unauthenticated = _CLASS_BY_CODE[StatusCode.UNAUTHENTICATED]
