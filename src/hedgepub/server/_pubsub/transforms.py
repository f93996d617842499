"""Single message transforms: JavaScript UDFs and compression, checked and applied as the real service does.

A topic or subscription holds a list of ``MessageTransform``; the enabled ones run in their order on
each message. A transform returns the message to pass on, or ``None`` (a UDF that returned ``null``:
the message is filtered out), or raises :class:`TransformFailed`.

- **JavaScript UDFs** run in QuickJS (the ``quickjs`` binding). Each UDF gets a JavaScript context of its
  own, which has no file, network or module access (QuickJS's ``std`` and ``os`` modules are not loaded),
  a CPU-time limit per call (:data:`UDF_TIME_LIMIT_SECONDS`) and a heap limit
  (:data:`UDF_MEMORY_LIMIT_BYTES`): an endless loop or a huge allocation fails the message at hand and
  nothing else. The function is called as ``name(message, metadata)``: ``message.data`` is the data
  decoded as UTF-8 (data that is not UTF-8 fails the message), ``message.attributes`` an object of
  strings; ``metadata`` has
  ``message_id``, ``publish_time`` (``YYYY-MM-DDTHH:MM:SSZ``) and ``ordering_key`` when the message has
  them. It returns ``null`` (filter) or an object with a string ``data`` and, optionally, ``attributes``
  (absent: the attributes stay as they were; ``{}``: all removed). Anything else fails the message.
- **Compression** (zlib or zstd, compress or decompress) works on the data; data that does not
  decompress, or decompresses past the 10 MB message limit, fails the message.
- **AI inference** transforms are refused (UNIMPLEMENTED, naming them) after their fields are checked.

The contexts of compiled UDFs are kept (:func:`pipeline_for` caches by the transforms' bytes and the
thread), so a UDF's global variables live on from one message to the next, as they may in the real
service. Deep recursion stops at QuickJS's stack limit (about 400 calls of a small function): a
``stack overflow`` fails the message like any other exception.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits
from hedgepub.server._pubsub.limits import ServiceError, check_message, invalid

__all__ = [
    "MAX_TRANSFORMS",
    "MAX_UDF_CODE_BYTES",
    "UDF_MEMORY_LIMIT_BYTES",
    "UDF_TIME_LIMIT_SECONDS",
    "Pipeline",
    "Step",
    "TransformFailed",
    "check_transforms",
    "metadata_of",
    "pipeline_for",
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
#: CPU time one call of a UDF may take (QuickJS counts the process's CPU time, not the wall clock, so a
#: busy machine does not fail a UDF that would pass on a quiet one).
UDF_TIME_LIMIT_SECONDS = 0.5
#: Heap of one UDF's JavaScript context.
UDF_MEMORY_LIMIT_BYTES = 64 * 1024 * 1024

_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_INVOKE = "__hedgepub_invoke"
# Runs after the user's code; the function name was checked to be an identifier. The message and
# metadata travel as JSON text (the binding passes strings, numbers and booleans only).
_INVOKE_CODE = """
function %(invoke)s(message, metadata) {
  var result = %(name)s(JSON.parse(message), JSON.parse(metadata));
  if (result === null) return null;
  if (result === undefined) return "!undefined";
  if (Array.isArray(result)) return "!array";
  if (typeof result !== "object") return "!" + typeof result;
  return JSON.stringify(result);
}
"""


class TransformFailed(Exception):
    """A transform could not process a message: ``index`` (in the resource's list) and the reason."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"message_transforms[{index}] failed: {reason}")
        self.index = index
        self.reason = reason


# ----------------------------------------------------------------- validation
def check_transforms(transforms: Sequence[Any], field: str = "message_transforms") -> None:
    """Check a topic's or subscription's ``message_transforms`` as the service does at create and update:
    INVALID_ARGUMENT with the reason (too many, code too large, a syntax error, a missing function, a
    function name used twice, a compression without algorithm or mode); AI inference: UNIMPLEMENTED."""
    if len(transforms) > MAX_TRANSFORMS:
        raise invalid(
            f"Invalid {field}: {len(transforms)} transforms given; a resource holds at most {MAX_TRANSFORMS}."
        )
    names: dict[str, int] = {}
    for index, transform in enumerate(transforms):
        where = f"{field}[{index}]"
        check_transform(transform, where)
        if transform.WhichOneof("transform") == "javascript_udf":
            name = transform.javascript_udf.function_name
            if name in names:
                raise invalid(
                    f"Invalid {where}: function_name {name!r} is already used by {field}[{names[name]}]; "
                    "each JavaScript UDF of a resource needs a function name of its own."
                )
            names[name] = index


def check_transform(transform: Any, where: str = "message_transform") -> None:
    """Check one ``MessageTransform`` (see :func:`check_transforms`)."""
    kind = transform.WhichOneof("transform")
    if kind is None:
        raise invalid(f"Invalid {where}: one of javascript_udf, compression or ai_inference must be set.")
    if kind == "javascript_udf":
        udf = transform.javascript_udf
        _Udf.compile(udf.code, udf.function_name, where)
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


# ----------------------------------------------------------------- JavaScript
class _Udf:
    """One compiled JavaScript UDF in a QuickJS context of its own."""

    def __init__(self, context: Any, function: Any, name: str) -> None:
        self._context = context
        self._function = function
        self.name = name

    @classmethod
    def compile(cls, code: str, name: str, where: str) -> _Udf:
        """Compile ``code`` and find ``name`` in it; INVALID_ARGUMENT saying what is wrong otherwise."""
        import quickjs  # only servers and tools that run transforms need the engine

        if not name:
            raise invalid(f"Invalid {where}: javascript_udf.function_name is required.")
        if not _IDENTIFIER.fullmatch(name):
            raise invalid(f"Invalid {where}: javascript_udf.function_name {name!r} is not a JavaScript name.")
        if not code.strip():
            raise invalid(f"Invalid {where}: javascript_udf.code is required.")
        size = len(code.encode())
        if size > MAX_UDF_CODE_BYTES:
            raise invalid(
                f"Invalid {where}: javascript_udf.code is {size} bytes; "
                f"at most {MAX_UDF_CODE_BYTES} are allowed."
            )
        context = quickjs.Context()
        context.set_memory_limit(UDF_MEMORY_LIMIT_BYTES)
        context.set_time_limit(UDF_TIME_LIMIT_SECONDS)
        try:
            context.eval(code)
        except quickjs.JSException as error:
            raise invalid(
                f"Invalid {where}: javascript_udf.code does not run: {_first_line(error)}"
            ) from None
        try:
            kind = context.eval(f"typeof {name}")
        except quickjs.JSException:  # only an unusual global (a getter that throws) gets here
            kind = "undefined"
        if kind != "function":
            raise invalid(
                f"Invalid {where}: javascript_udf.code defines no function named {name!r} "
                f"(typeof {name} is {kind})."
            )
        context.eval(_INVOKE_CODE % {"invoke": _INVOKE, "name": name})
        return cls(context, context.get(_INVOKE), name)

    def __call__(self, message: dict[str, Any], metadata: dict[str, str]) -> str | None:
        """The function's result as JSON text, ``None`` for ``null``, ``"!type"`` for a wrong type."""
        import quickjs

        try:
            return self._function(json.dumps(message), json.dumps(metadata))
        except quickjs.JSException as error:
            self._context.gc()  # what a call that ran out of memory left behind
            raise _UdfError(_first_line(error)) from None


class _UdfError(Exception):
    pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


_Apply = Callable[[Any, dict[str, str]], Any]


class Pipeline:
    """The enabled transforms of a resource, compiled, applied in their order."""

    def __init__(self, transforms: Sequence[Any]) -> None:
        self._steps: list[tuple[int, _Apply]] = []
        for index, transform in enumerate(transforms):
            if transform.disabled:
                continue
            where = f"message_transforms[{index}]"
            check_transform(transform, where)
            kind = transform.WhichOneof("transform")
            if kind == "javascript_udf":
                udf = transform.javascript_udf
                self._steps.append((index, _udf_step(_Udf.compile(udf.code, udf.function_name, where))))
            else:
                self._steps.append((index, _compression_step(transform.compression)))

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        return f"<Pipeline of {len(self._steps)} enabled transforms>"

    def apply(self, message: Any) -> Any | None:
        """The message after every enabled transform (a new object; ``message`` is left as it was), or
        ``None`` when one filtered it out. Raises :class:`TransformFailed`."""
        metadata = metadata_of(message)
        current = message
        for index, step in self._steps:
            try:
                current = step(current, metadata)
            except _StepError as error:
                raise TransformFailed(index, str(error)) from None
            if current is None:
                return None
        return current if current is not message else _copy(message)

    def trace(self, message: Any) -> list[Step]:
        """Each enabled transform's result in turn, up to the first that filters or fails."""
        metadata = metadata_of(message)
        steps: list[Step] = []
        current = message
        for index, step in self._steps:
            try:
                current = step(current, metadata)
            except _StepError as error:
                steps.append(Step(index, None, str(error)))
                break
            steps.append(Step(index, current if current is None else _copy(current)))
            if current is None:
                break
        return steps


class _StepError(Exception):
    pass


def _copy(message: Any) -> Any:
    copy = PubsubMessage()
    copy.CopyFrom(message)
    return copy


def _udf_step(udf: _Udf) -> _Apply:
    def apply(message: Any, metadata: dict[str, str]) -> Any | None:
        try:
            text = bytes(message.data).decode("utf-8")
        except UnicodeDecodeError:
            raise _StepError("the message data is not UTF-8 text, which a JavaScript UDF needs") from None
        try:
            result = udf({"data": text, "attributes": dict(message.attributes)}, metadata)
        except _UdfError as error:
            raise _StepError(f"{udf.name} threw: {error}") from None
        if result is None:
            return None
        if result.startswith("!"):
            raise _StepError(f"{udf.name} returned {result[1:]}; it must return an object or null")
        returned = json.loads(result)
        data = returned.get("data")
        if not isinstance(data, str):
            raise _StepError(f"{udf.name} returned an object whose 'data' is not a string")
        transformed = PubsubMessage()
        transformed.CopyFrom(message)
        transformed.data = data.encode()
        if "attributes" in returned:
            attributes = returned["attributes"]
            if not isinstance(attributes, dict) or not all(isinstance(v, str) for v in attributes.values()):
                raise _StepError(f"{udf.name} returned 'attributes' that are not an object of strings")
            transformed.ClearField("attributes")
            transformed.attributes.update(attributes)
        _check_result(transformed)
        return transformed

    return apply


def _check_result(message: Any) -> None:
    try:
        check_message(message)
    except ServiceError as error:
        raise _StepError(f"the transformed message is not a valid message: {error.message}") from None


def _compression_step(compression: Any) -> _Apply:
    zstd = compression.compression_algorithm == _ZSTD
    compress = compression.compression_mode == _COMPRESS
    name = "zstd" if zstd else "zlib"

    def apply(message: Any, metadata: dict[str, str]) -> Any:
        data = bytes(message.data)
        if compress:
            out = _zstd_compress(data) if zstd else zlib.compress(data)
        else:
            out = _zstd_decompress(data) if zstd else _zlib_decompress(data)
        transformed = PubsubMessage()
        transformed.CopyFrom(message)
        transformed.data = out
        return transformed

    def checked(message: Any, metadata: dict[str, str]) -> Any:
        try:
            return apply(message, metadata)
        except _StepError:
            raise
        except Exception as error:  # zlib.error, zstandard.ZstdError: data that is not what it claims
            mode = "compress" if compress else "decompress"
            raise _StepError(f"{name} could not {mode} the data: {error}") from None

    return checked


def _too_large() -> _StepError:
    return _StepError(f"the data decompresses to more than {limits.MAX_MESSAGE_DATA_BYTES} bytes")


def _zlib_decompress(data: bytes) -> bytes:
    decompressor = zlib.decompressobj()
    out = decompressor.decompress(data, limits.MAX_MESSAGE_DATA_BYTES + 1)
    if len(out) > limits.MAX_MESSAGE_DATA_BYTES or decompressor.unconsumed_tail:
        raise _too_large()
    if not decompressor.eof:
        raise _StepError("zlib could not decompress the data: it ends before the compressed stream does")
    return out


def _zstd_compress(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def _zstd_decompress(data: bytes) -> bytes:
    import zstandard

    # A stream reader bounds what a small frame may expand to; the decompression object then tells a
    # whole frame from a cut one (the reader ends quietly at a cut).
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    size = 0
    while chunk := reader.read(1 << 20):
        size += len(chunk)
        if size > limits.MAX_MESSAGE_DATA_BYTES:
            raise _too_large()
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    out = decompressor.decompress(data)
    if not decompressor.eof:
        raise _StepError("zstd could not decompress the data: it ends before the compressed frame does")
    return out


# ----------------------------------------------------------------- cache
_CACHE_SIZE = 256
_cache: OrderedDict[bytes, Pipeline] = OrderedDict()


def pipeline_for(transforms: Sequence[Any]) -> Pipeline | None:
    """The compiled pipeline of a resource's ``message_transforms`` (``None`` when none is enabled).

    Kept by the transforms' serialized bytes, so a topic or subscription compiles its UDFs once, and an
    update that changes them compiles the new ones. Raises what :func:`check_transforms` raises for
    transforms that no longer compile (stored by an older server).
    """
    if not transforms or all(transform.disabled for transform in transforms):
        return None
    # Per thread too: a JavaScript context is used only by the thread that made it (each LocalServer runs
    # its own event loop thread), and servers in one process do not share a UDF's global variables.
    key = threading.get_ident().to_bytes(8, "little") + b"".join(
        transform.SerializeToString() + b"\x00" for transform in transforms
    )
    found = _cache.get(key)
    if found is None:
        found = Pipeline(transforms)
        _cache[key] = found
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return found
