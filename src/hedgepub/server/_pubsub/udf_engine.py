"""The transform engine on plain data: JavaScript UDFs in QuickJS, and zlib / zstd compression.

Both the sandbox workers (:mod:`.udf_worker`, which load this file by itself, without the hedgepub
package) and the in-process pipeline of ``hedgepub transforms test`` run it, so this module imports
nothing of hedgepub. A message is ``(data: bytes, attributes: dict[str, str])``; a chain of steps gives,
per message, the outcome of each step it ran (:meth:`Chain.run`).

Each UDF gets a QuickJS context of its own, with a prelude that runs before the user's code: it keeps
the engine's own ``JSON.parse``, ``JSON.stringify``, ``Object.keys`` and friends in a closure, and
defines one non-writable, non-configurable global (``__hedgepub_bind``), so a UDF that overrides
``JSON.stringify``, freezes the global object or gives its result a ``toJSON`` cannot break the
marshalling of messages. The result is read field by field (``data`` a string, ``attributes`` an object
of strings), never serialized as the UDF made it.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

#: Largest data a step may produce (the service's 10 MB message limit; hedgepub's limits module checks
#: this equals its own).
MAX_DATA_BYTES = 10_000_000
#: Longest error text a failed UDF gives (longer ones are cut): it travels in a gRPC status, whose
#: metadata is limited to 8 KiB by default.
MAX_ERROR_CHARS = 1000
#: CPU time one call of a UDF may take (QuickJS checks it while JavaScript code runs).
CALL_SECONDS = 0.5
#: Heap of one UDF's JavaScript context.
HEAP_BYTES = 64 * 1024 * 1024

PRELUDE = r"""
(function (global) {
  var parse = JSON.parse, stringify = JSON.stringify, isArray = Array.isArray, keys = Object.keys,
      create = Object.create, defineProperty = Object.defineProperty;
  function bind(fn) {
    return function (messageText, metadataText) {
      var result = fn(parse(messageText), parse(metadataText));
      if (result === null) return null;
      if (result === undefined) return "!undefined";
      if (typeof result !== "object") return "!" + typeof result;
      if (isArray(result)) return "!array";
      var data = result.data;
      if (typeof data !== "string") return "?data";
      var out = create(null);
      out.data = data;
      var attributes = result.attributes;
      if (attributes !== undefined) {
        if (attributes === null || typeof attributes !== "object" || isArray(attributes)) {
          return "?attributes";
        }
        var names = keys(attributes), copied = create(null);
        for (var i = 0; i < names.length; i++) {
          var value = attributes[names[i]];
          if (typeof value !== "string") return "?attributes";
          copied[names[i]] = value;
        }
        out.attributes = copied;
      }
      return stringify(out);
    };
  }
  defineProperty(global, "__hedgepub_bind", {
    value: bind, writable: false, configurable: false, enumerable: false
  });
})(globalThis);
"""

_RESULT_ERRORS = {
    "?data": "returned an object whose 'data' is not a string",
    "?attributes": "returned 'attributes' that are not an object of strings",
}

#: One enabled transform: ``("udf", index, code, function_name)`` or ``("compression", index, zstd,
#: compress)`` (two booleans).
Step = tuple[Any, ...]
#: What one step made of a message: ``("ok", data, attributes)``, ``("filtered",)`` or ``("failed", why)``.
Outcome = tuple[Any, ...]


class StepError(Exception):
    """A step could not process a message; the text says why."""


class CompileError(Exception):
    """A UDF's code does not compile, or defines no function of its name; the text says what."""


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` at most ``limit`` characters long (with an ellipsis when cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(error: BaseException) -> str:
    """The first line of an error's text, cut to :data:`MAX_ERROR_CHARS`."""
    text = str(error).strip()
    if "Failed obtaining QuickJS error string" in text:  # the binding's words for an error it lost
        return "an error the engine could not describe (most often: out of memory)"
    return cut(text.splitlines()[0] if text else type(error).__name__)


class Udf:
    """One compiled JavaScript UDF in a QuickJS context of its own."""

    def __init__(self, code: str, name: str) -> None:
        import quickjs  # only processes that run transforms need the engine

        self.name = name
        context = quickjs.Context()
        context.set_memory_limit(HEAP_BYTES)
        context.set_time_limit(CALL_SECONDS)
        context.eval(PRELUDE)
        try:
            context.eval(code)
        except Exception as error:  # JSException, or a result the binding cannot convert
            raise CompileError(f"javascript_udf.code does not run: {first_line(error)}") from None
        try:
            bound = context.eval(f"typeof {name} === 'function' ? __hedgepub_bind({name}) : typeof {name}")
        except Exception:  # only an unusual global (a getter that throws) gets here
            bound = "undefined"
        if isinstance(bound, str) or bound is None:
            raise CompileError(
                f"javascript_udf.code defines no function named {name!r} (typeof {name} is {bound})."
            )
        self._context = context
        self._function = bound

    def set_time_limit(self, seconds: float) -> None:
        """CPU time the next calls may take each."""
        self._context.set_time_limit(seconds)

    def memory(self) -> int:
        """Bytes the context's heap holds now."""
        return int(self._context.memory()["memory_used_size"])

    def __call__(self, message_text: str, metadata_text: str) -> str | None:
        """The function's result: JSON text of ``{data, attributes}``, ``None`` for ``null``, ``"!type"`` or
        ``"?field"`` for a result of the wrong shape. Raises :class:`StepError` when it throws."""
        try:
            return self._function(message_text, metadata_text)
        except Exception as error:  # JSException; UnicodeDecodeError for a string the binding cannot read
            self._context.gc()  # what a call that ran out of memory left behind
            raise StepError(first_line(error)) from None


def _udf_step(udf: Udf, data: bytes, attributes: dict[str, str], metadata_text: str) -> Outcome:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise StepError("the message data is not UTF-8 text, which a JavaScript UDF needs") from None
    try:
        result = udf(json.dumps({"data": text, "attributes": attributes}), metadata_text)
    except StepError as error:
        raise StepError(f"{udf.name} threw: {error}") from None
    if result is None:
        return ("filtered",)
    if result.startswith("!"):
        raise StepError(f"{udf.name} returned {result[1:]}; it must return an object or null")
    if result.startswith("?"):
        raise StepError(f"{udf.name} {_RESULT_ERRORS[result]}")
    returned = json.loads(result)
    try:
        out = returned["data"].encode("utf-8")
        new_attributes = attributes
        if "attributes" in returned:
            new_attributes = returned["attributes"]
            for key, value in new_attributes.items():
                key.encode("utf-8")
                value.encode("utf-8")
    except UnicodeEncodeError:
        raise StepError(
            f"{udf.name} returned text that is not valid Unicode (a lone surrogate, such as half of an "
            "emoji cut by substring); data and attributes must be whole characters"
        ) from None
    if len(out) > MAX_DATA_BYTES:
        raise StepError(
            f"{udf.name} returned data of {len(out)} bytes; a message holds at most {MAX_DATA_BYTES}"
        )
    return ("ok", out, new_attributes)


class Chain:
    """The enabled transforms of a resource, compiled, applied in their order to plain messages.

    A UDF that does not compile makes every message fail at its step (the server checked the code when
    the resource was made; only code that runs differently now gets here).
    """

    def __init__(self, steps: list[Step]) -> None:
        self._steps: list[tuple[int, Any]] = []
        for step in steps:
            if step[0] == "udf":
                _, index, code, name = step
                try:
                    self._steps.append((index, Udf(code, name)))
                except CompileError as error:
                    self._steps.append((index, error))
            else:
                _, index, zstd, compress = step
                self._steps.append((index, (bool(zstd), bool(compress))))

    def udfs(self) -> list[Udf]:
        """The chain's compiled UDFs."""
        return [step for _, step in self._steps if isinstance(step, Udf)]

    def memory(self) -> int:
        """Bytes the chain's JavaScript heaps hold now."""
        return sum(udf.memory() for udf in self.udfs())

    def set_time_limit(self, seconds: float) -> None:
        """CPU time each UDF call may take from now on."""
        for udf in self.udfs():
            udf.set_time_limit(seconds)

    def run(
        self, data: bytes, attributes: dict[str, str], metadata: dict[str, str], trace: bool = False
    ) -> list[tuple[int, Outcome]]:
        """Run the steps on one message: ``(index, outcome)`` of each step run, up to the first that
        filtered or failed (``trace``), or only the last one (otherwise)."""
        metadata_text = json.dumps(metadata)
        done: list[tuple[int, Outcome]] = []
        for index, step in self._steps:
            try:
                if isinstance(step, Udf):
                    outcome = _udf_step(step, data, attributes, metadata_text)
                elif isinstance(step, CompileError):
                    raise StepError(str(step))
                else:
                    outcome = ("ok", _compression(data, *step), attributes)
            except StepError as error:
                outcome = ("failed", cut(str(error)))
            if trace or outcome[0] != "ok":
                done.append((index, outcome))
            if outcome[0] != "ok":
                return done
            _, data, attributes = outcome
        if not trace:
            done.append((-1, ("ok", data, attributes)))
        return done


# ----------------------------------------------------------------- compression
def _compression(data: bytes, zstd: bool, compress: bool) -> bytes:
    name = "zstd" if zstd else "zlib"
    try:
        if compress:
            return _zstd_compress(data) if zstd else zlib.compress(data)
        return _zstd_decompress(data) if zstd else _zlib_decompress(data)
    except StepError:
        raise
    except Exception as error:  # zlib.error, zstandard.ZstdError: data that is not what it claims
        mode = "compress" if compress else "decompress"
        raise StepError(f"{name} could not {mode} the data: {error}") from None


def _too_large() -> StepError:
    return StepError(f"the data decompresses to more than {MAX_DATA_BYTES} bytes")


def _zlib_decompress(data: bytes) -> bytes:
    decompressor = zlib.decompressobj()
    out = decompressor.decompress(data, MAX_DATA_BYTES + 1)
    if len(out) > MAX_DATA_BYTES or decompressor.unconsumed_tail:
        raise _too_large()
    if not decompressor.eof:
        raise StepError("zlib could not decompress the data: it ends before the compressed stream does")
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
        if size > MAX_DATA_BYTES:
            raise _too_large()
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    out = decompressor.decompress(data)
    if not decompressor.eof:
        raise StepError("zstd could not decompress the data: it ends before the compressed frame does")
    return out
