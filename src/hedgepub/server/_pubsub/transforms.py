"""Single message transforms: JavaScript UDFs and compression, checked and applied as the real service does.

A topic or subscription holds a list of ``MessageTransform``; the enabled ones run in their order on
each message. A transform returns the message to pass on, or ``None`` (a UDF that returned ``null``:
the message is filtered out), or raises :class:`TransformFailed`.

- **JavaScript UDFs** run in QuickJS (the ``quickjs`` binding, through :mod:`.udf_engine`). On the
  server they run in sandbox worker processes (:mod:`.udf_sandbox`), never in the server's own: a UDF
  that crashes the engine, ignores its time limit or holds memory costs its own messages and nothing
  else. Each UDF gets a JavaScript context of its own, with no file, network or module access, a
  CPU-time limit per call (:data:`UDF_TIME_LIMIT_SECONDS`), a budget per request
  (:data:`~.udf_sandbox.REQUEST_SECONDS`) and a heap limit (:data:`UDF_MEMORY_LIMIT_BYTES`). The
  function is called as ``name(message, metadata)``: ``message.data`` is the data decoded as UTF-8
  (data that is not UTF-8 fails the message), ``message.attributes`` an object of strings; ``metadata``
  has ``message_id``, ``publish_time`` (``YYYY-MM-DDTHH:MM:SSZ``) and ``ordering_key`` when the message
  has them. It returns ``null`` (filter) or an object with a string ``data`` and, optionally,
  ``attributes`` (absent: the attributes stay as they were; ``{}``: all removed). Anything else fails
  the message, with an error of at most 1,000 characters.
  Without QuickJS installed (the ``quickjs`` module of the ``server`` extra), the server runs and refuses
  a UDF (FAILED_PRECONDITION, saying what to install) when it would compile one.
- **Compression** (zlib or zstd, compress or decompress) works on the data; data that does not
  decompress, or decompresses past the 10 MB message limit, fails the message.
- **AI inference** transforms are refused (UNIMPLEMENTED, naming them) after their fields are checked.

The server's :class:`Transforms` keeps a context per topic or subscription (by its full name, so never
shared across resources or projects) in each worker, so a UDF's global variables may live on from one
message to the next, as they may in the real service; deleting the resource releases them. Deep
recursion stops at QuickJS's stack limit: a ``stack overflow`` fails the message like any other error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import udf_engine
from hedgepub.server._pubsub.limits import ServiceError, check_message, invalid
from hedgepub.server._pubsub.udf_sandbox import Sandbox

__all__ = [
    "MAX_TRANSFORMS",
    "MAX_UDF_CODE_BYTES",
    "UDF_MEMORY_LIMIT_BYTES",
    "UDF_TIME_LIMIT_SECONDS",
    "NotRun",
    "Pipeline",
    "Step",
    "TransformFailed",
    "Transforms",
    "check_transforms",
    "metadata_of",
    "steps_of",
]

PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
MessageTransform: Any = pubsub_types.MessageTransform.pb()
_Compression: Any = MessageTransform.DESCRIPTOR.fields_by_name["compression"].message_type
_ZSTD = _Compression.enum_values_by_name["ZSTD"].number
_COMPRESS = _Compression.enum_values_by_name["COMPRESS"].number

#: Transforms a topic or subscription may hold.
MAX_TRANSFORMS = 5
#: Size of one UDF's code, in UTF-8 bytes.
MAX_UDF_CODE_BYTES = 20 * 1024
#: CPU time one call of a UDF may take (QuickJS counts CPU time, not the wall clock, so a busy machine
#: does not fail a UDF that would pass on a quiet one).
UDF_TIME_LIMIT_SECONDS = udf_engine.CALL_SECONDS
#: Heap of one UDF's JavaScript context.
UDF_MEMORY_LIMIT_BYTES = udf_engine.HEAP_BYTES

_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")


class TransformFailed(Exception):
    """A transform could not process a message: ``index`` (in the resource's list) and the reason."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"message_transforms[{index}] failed: {reason}")
        self.index = index
        self.reason = reason


# ----------------------------------------------------------------- validation
def check_transforms(
    transforms: Sequence[Any], field: str = "message_transforms", *, run_code: bool = True
) -> None:
    """Check a topic's or subscription's ``message_transforms`` as the service does at create and update:
    INVALID_ARGUMENT with the reason (too many, code too large, a syntax error, a missing function, a
    function name used twice, a compression without algorithm or mode); AI inference: UNIMPLEMENTED.

    ``run_code``: compile each UDF (running its top-level code) in this process; the server says False
    and compiles them in its sandbox (:meth:`Transforms.validate`)."""
    if len(transforms) > MAX_TRANSFORMS:
        raise invalid(
            f"Invalid {field}: {len(transforms)} transforms given; a resource holds at most {MAX_TRANSFORMS}."
        )
    names: dict[str, int] = {}
    for index, transform in enumerate(transforms):
        where = f"{field}[{index}]"
        check_transform(transform, where, run_code=run_code)
        if transform.WhichOneof("transform") == "javascript_udf":
            name = transform.javascript_udf.function_name
            if name in names:
                raise invalid(
                    f"Invalid {where}: function_name {name!r} is already used by {field}[{names[name]}]; "
                    "each JavaScript UDF of a resource needs a function name of its own."
                )
            names[name] = index


def require_quickjs(where: str) -> None:
    """FAILED_PRECONDITION if QuickJS (the ``quickjs`` module) is not installed: ``where`` holds a UDF."""
    if importlib.util.find_spec("quickjs") is None:
        raise ServiceError(
            StatusCode.FAILED_PRECONDITION,
            f"{where}: JavaScript UDFs run in QuickJS, which is not installed with this server (the "
            "quickjs module of the 'server' extra): pip install 'hedgepub[server]'",
        )


def check_transform(transform: Any, where: str = "message_transform", *, run_code: bool = True) -> None:
    """Check one ``MessageTransform`` (see :func:`check_transforms`)."""
    kind = transform.WhichOneof("transform")
    if kind is None:
        raise invalid(f"Invalid {where}: one of javascript_udf, compression or ai_inference must be set.")
    if kind == "javascript_udf":
        udf = transform.javascript_udf
        _check_udf(udf.code, udf.function_name, where)
        if run_code:
            require_quickjs(where)
            try:
                udf_engine.Udf(udf.code, udf.function_name)
            except udf_engine.CompileError as error:
                raise invalid(f"Invalid {where}: {error}") from None
    elif kind == "compression":
        compression = transform.compression
        if compression.compression_algorithm == 0:
            raise invalid(f"Invalid {where}: compression.compression_algorithm must be ZLIB or ZSTD.")
        if compression.compression_mode == 0:
            raise invalid(f"Invalid {where}: compression.compression_mode must be COMPRESS or DECOMPRESS.")
    else:
        inference = transform.ai_inference
        if not inference.endpoint:
            raise invalid(f"Invalid {where}: ai_inference.endpoint is required.")
        raise ServiceError(
            StatusCode.UNIMPLEMENTED,
            f"{where}: ai_inference transforms (endpoint {inference.endpoint}) are not supported by this "
            "server, which cannot reach Vertex AI; use javascript_udf or compression transforms.",
        )


def _check_udf(code: str, name: str, where: str) -> None:
    """What is checked of a UDF without running it: a function name, code of a size allowed."""
    if not name:
        raise invalid(f"Invalid {where}: javascript_udf.function_name is required.")
    if not _IDENTIFIER.fullmatch(name):
        raise invalid(f"Invalid {where}: javascript_udf.function_name {name!r} is not a JavaScript name.")
    if not code.strip():
        raise invalid(f"Invalid {where}: javascript_udf.code is required.")
    size = len(code.encode())
    if size > MAX_UDF_CODE_BYTES:
        raise invalid(
            f"Invalid {where}: javascript_udf.code is {size} bytes; at most {MAX_UDF_CODE_BYTES} are allowed."
        )


# ----------------------------------------------------------------- pipelines
@dataclass(frozen=True)
class Step:
    """What one enabled transform made of a message (``testMessageTransforms`` reports each)."""

    #: The transform's position in the resource's list.
    index: int
    #: The message after the transform; ``None`` when it was filtered out or the transform failed.
    message: Any | None
    #: Why the transform failed (``None`` when it did not).
    error: str | None = None


class NotRun(Exception):
    """A message whose transforms were not run: its request's CPU budget was spent on the messages before
    it, or an earlier message's transforms stopped their sandbox worker (the text says which)."""


def metadata_of(message: Any) -> dict[str, str]:
    """A UDF's ``metadata`` argument for ``message``: what it has of its ID, publish time, ordering key."""
    metadata: dict[str, str] = {}
    if message.message_id:
        metadata["message_id"] = message.message_id
    if message.HasField("publish_time"):
        metadata["publish_time"] = message.publish_time.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ")
    if message.ordering_key:
        metadata["ordering_key"] = message.ordering_key
    return metadata


def steps_of(transforms: Sequence[Any]) -> list[udf_engine.Step]:
    """The enabled transforms as the engine takes them (plain data)."""
    steps: list[udf_engine.Step] = []
    for index, transform in enumerate(transforms):
        if transform.disabled:
            continue
        kind = transform.WhichOneof("transform")
        if kind == "javascript_udf":
            udf = transform.javascript_udf
            steps.append(("udf", index, udf.code, udf.function_name))
        elif kind == "compression":
            compression = transform.compression
            steps.append(
                (
                    "compression",
                    index,
                    compression.compression_algorithm == _ZSTD,
                    compression.compression_mode == _COMPRESS,
                )
            )
    return steps


def _plain(message: Any) -> tuple[bytes, dict[str, str], dict[str, str]]:
    return bytes(message.data), dict(message.attributes), metadata_of(message)


def _made(original: Any, outcome: udf_engine.Outcome) -> Any:
    """The message a step's ``("ok", data, attributes)`` stands for; raises :class:`_StepError` for one
    that is not a valid message."""
    made = PubsubMessage()
    made.CopyFrom(original)
    made.data = outcome[1]
    made.ClearField("attributes")
    made.attributes.update(outcome[2])
    try:
        check_message(made)
    except ServiceError as error:
        raise _StepError(f"the transformed message is not a valid message: {error.message}") from None
    return made


class _StepError(Exception):
    pass


def _result(message: Any, outcomes: list[tuple[int, udf_engine.Outcome]], last: int) -> Any:
    """What :meth:`Pipeline.apply` gives for one message's outcomes: the message, ``None`` (filtered), or
    an exception (:class:`TransformFailed`, :class:`NotRun`) to raise or report. ``last``: the index of
    the last enabled transform (which made the message a final check refuses)."""
    index, outcome = outcomes[-1]
    if outcome[0] == "ok":
        try:
            return _made(message, outcome)
        except _StepError as error:
            return TransformFailed(last, str(error))
    if outcome[0] == "filtered":
        return None
    if outcome[0] == "failed":
        return TransformFailed(max(index, 0), outcome[1])
    return NotRun(outcome[1])


def _trace(message: Any, outcomes: list[tuple[int, udf_engine.Outcome]]) -> list[Step]:
    steps: list[Step] = []
    current = message
    for index, outcome in outcomes:
        if outcome[0] == "ok":
            try:
                current = _made(current, outcome)
            except _StepError as error:
                steps.append(Step(index, None, str(error)))
                break
            steps.append(Step(index, _copy(current)))
        elif outcome[0] == "filtered":
            steps.append(Step(index, None))
        else:
            steps.append(Step(max(index, 0), None, outcome[1]))
    return steps


def _copy(message: Any) -> Any:
    copy = PubsubMessage()
    copy.CopyFrom(message)
    return copy


class Pipeline:
    """The enabled transforms of a resource, compiled and applied in this process, in their order.

    For ``hedgepub transforms test`` and tools; the server runs transforms in its sandbox
    (:class:`Transforms`), never in its own process.
    """

    def __init__(self, transforms: Sequence[Any]) -> None:
        for index, transform in enumerate(transforms):
            if not transform.disabled:
                check_transform(transform, f"message_transforms[{index}]")
        steps = steps_of(transforms)
        self._chain = udf_engine.Chain(steps)
        self._size = len(steps)
        self._last = steps[-1][1] if steps else 0

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"<Pipeline of {self._size} enabled transforms>"

    def apply(self, message: Any) -> Any | None:
        """The message after every enabled transform (a new object; ``message`` is left as it was), or
        ``None`` when one filtered it out. Raises :class:`TransformFailed`."""
        result = _result(message, self._chain.run(*_plain(message)), self._last)
        if isinstance(result, Exception):
            raise result
        return result

    def trace(self, message: Any) -> list[Step]:
        """Each enabled transform's result in turn, up to the first that filters or fails."""
        return _trace(message, self._chain.run(*_plain(message), trace=True))


# ----------------------------------------------------------------- the server's transforms
def _digest(transforms: Sequence[Any]) -> str:
    return hashlib.sha256(b"".join(t.SerializeToString() + b"\x00" for t in transforms)).hexdigest()


class Transforms:
    """The transforms of one server: UDFs in its sandbox (:mod:`.udf_sandbox`, started on first use),
    compression alone in this process. Each topic or subscription keeps its own JavaScript contexts (by
    its full name), released when it is deleted (:meth:`forget`)."""

    def __init__(self, sandbox: Callable[[], Sandbox] | None = None) -> None:
        self._make = sandbox or Sandbox
        self._sandbox: Sandbox | None = None

    def _pool(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = self._make()
        return self._sandbox

    async def validate(self, transforms: Sequence[Any], field: str = "message_transforms") -> None:
        """:func:`check_transforms`, then each UDF compiled (its top-level code run) in the sandbox:
        INVALID_ARGUMENT naming what is wrong. Disabled UDFs are checked too, as the service checks
        every transform it stores."""
        check_transforms(transforms, field, run_code=False)
        await self._compile(transforms, lambda index: f"{field}[{index}]")

    async def validate_one(self, transform: Any, where: str = "message_transform") -> None:
        """:meth:`validate` for one transform (``validateMessageTransform``)."""
        check_transform(transform, where, run_code=False)
        await self._compile([transform], lambda index: where)

    async def _compile(self, transforms: Sequence[Any], where: Callable[[int], str]) -> None:
        steps = [
            ("udf", index, transform.javascript_udf.code, transform.javascript_udf.function_name)
            for index, transform in enumerate(transforms)
            if transform.WhichOneof("transform") == "javascript_udf"
        ]
        if steps:
            require_quickjs(where(steps[0][1]))
            failed = await self._pool().validate(steps)
            if failed is not None:
                raise invalid(f"Invalid {where(failed[0])}: {failed[1]}")

    async def apply(self, resource: str, transforms: Sequence[Any], messages: Sequence[Any]) -> list[Any]:
        """Each message after ``resource``'s enabled transforms: the new message, ``None`` (filtered out),
        or the :class:`TransformFailed` or :class:`NotRun` that stands for it."""
        steps = steps_of(transforms)
        plain = [_plain(message) for message in messages]
        if any(step[0] == "udf" for step in steps):
            outcomes = await self._pool().run((resource, _digest(transforms)), steps, plain)
        else:  # compression alone: bounded work, no code of the caller's
            chain = udf_engine.Chain(steps)
            outcomes = [chain.run(*message) for message in plain]
        last = steps[-1][1] if steps else 0
        return [_result(message, found, last) for message, found in zip(messages, outcomes, strict=True)]

    async def trace(self, transforms: Sequence[Any], message: Any) -> list[Step]:
        """:meth:`Pipeline.trace` of ``transforms`` given inline or read from a resource, in contexts used
        once (``testMessageTransforms``)."""
        steps = steps_of(transforms)
        if any(step[0] == "udf" for step in steps):
            outcomes = (await self._pool().run(None, steps, [_plain(message)], trace=True))[0]
        else:
            outcomes = udf_engine.Chain(steps).run(*_plain(message), trace=True)
        return _trace(message, outcomes)

    async def forget(self, resource: str) -> None:
        """``resource`` was deleted: its JavaScript contexts go."""
        if self._sandbox is not None:
            await self._sandbox.forget(resource)

    async def close(self) -> None:
        """End the sandbox's workers (a later use starts new ones)."""
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await sandbox.close()
