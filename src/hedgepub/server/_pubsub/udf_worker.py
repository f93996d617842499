"""A sandbox worker: runs message transforms for the server, in a process of its own.

Started by :mod:`.udf_sandbox` as ``python udf_worker.py`` (this file as a script, so that it loads
:mod:`.udf_engine` beside it and nothing of the hedgepub package). It reads requests from stdin and writes
answers to stdout, each a frame: a 4-byte big-endian length, then a pickle of plain data (tuples, lists,
dicts, bytes, str, int, float, bool, None).

Requests:

- ``("run", key, steps, messages, trace, budget)``: run the chain ``steps`` (see ``udf_engine.Step``) on
  each ``(data, attributes, metadata)`` of ``messages``; ``key`` is ``(resource, digest)`` for the chain
  a resource keeps (its JavaScript globals live on between requests), or ``None`` for a chain used once.
  Answers: ``("result", position, outcomes)`` per message, as each is done, then ``("done",)``; or,
  when the request's ``budget`` of CPU seconds is spent before a message, ``("spent", position)`` and
  ``("done",)``.
- ``("validate", steps)``: compile each UDF in a context used once; ``("valid", None)`` or
  ``("valid", (index, reason))``.
- ``("forget", resource)``: drop the chains of ``resource`` (deleted); no answer.

Limits enforced here: an address-space limit (``RLIMIT_AS``), a CPU-time limit per request
(``RLIMIT_CPU``, which ends the process with SIGXCPU where QuickJS does not stop itself, as in a regular
expression that backtracks), the per-call time limit of each context, and a bound on the bytes the kept
contexts hold (least recently used ones are dropped). The server restarts a worker that dies.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import resource
import struct
import sys
import time
from collections import OrderedDict
from typing import Any, BinaryIO

if __package__:  # imported as part of hedgepub (tests, the in-process engine)
    from hedgepub.server._pubsub import udf_engine as engine
else:  # run as a script by the sandbox: the engine is beside this file (put first even under -P)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # The same module as above, found beside this file: mypy sees neither the path nor a second name.
    import udf_engine as engine  # type: ignore[import-not-found,no-redef]

#: Address space of a worker.
ADDRESS_SPACE_BYTES = 1024 * 1024 * 1024
_HEADER = struct.Struct(">I")


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's value, or ``None`` at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


def write_frame(stream: BinaryIO, value: Any) -> None:
    """Write one frame and flush it."""
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


class Worker:
    """The chains a worker keeps, bounded in bytes, and the requests it answers."""

    def __init__(self, out: BinaryIO, context_bytes: int) -> None:
        self._out = out
        self._context_bytes = context_bytes
        self._chains: OrderedDict[Any, tuple[engine.Chain, int]] = OrderedDict()

    def handle(self, request: tuple[Any, ...]) -> None:
        """Answer one request."""
        kind = request[0]
        if kind == "run":
            self._run(*request[1:])
        elif kind == "validate":
            write_frame(self._out, ("valid", _validate(request[1])))
        elif kind == "forget":
            for key in [key for key in self._chains if key[0] == request[1]]:
                del self._chains[key]

    def _chain(self, key: Any, steps: list[engine.Step]) -> engine.Chain:
        if key is None:
            return engine.Chain(steps)
        found = self._chains.get(key)
        if found is None:
            # A resource keeps one chain: its earlier transforms (before an update) go.
            for old in [old for old in self._chains if old[0] == key[0]]:
                del self._chains[old]
            chain = engine.Chain(steps)
            self._chains[key] = (chain, chain.memory())
            return chain
        self._chains.move_to_end(key)
        return found[0]

    def _run(
        self, key: Any, steps: list[engine.Step], messages: list[Any], trace: bool, budget: float
    ) -> None:
        _limit_cpu(budget)
        started = time.process_time()
        chain = self._chain(key, steps)
        for position, (data, attributes, metadata) in enumerate(messages):
            remaining = budget - (time.process_time() - started)
            if remaining <= 0:
                write_frame(self._out, ("spent", position))
                break
            limit = min(engine.CALL_SECONDS, remaining)
            chain.set_time_limit(limit)
            outcomes = chain.run(data, attributes, metadata, trace)
            if limit < engine.CALL_SECONDS and time.process_time() - started >= budget:
                # Stopped by what was left of the request's budget, not by the call's own limit.
                write_frame(self._out, ("spent", position))
                break
            write_frame(self._out, ("result", position, outcomes))
        write_frame(self._out, ("done",))
        if key is not None and key in self._chains:
            self._chains[key] = (chain, chain.memory())
            self._bound()

    def _bound(self) -> None:
        """Drop the least recently used chains while the kept ones hold more than the bound (the one
        just used stays)."""
        total = sum(size for _, size in self._chains.values())
        while total > self._context_bytes and len(self._chains) > 1:
            _, (_, size) = self._chains.popitem(last=False)
            total -= size


def _validate(steps: list[engine.Step]) -> tuple[int, str] | None:
    for step in steps:
        if step[0] == "udf":
            try:
                engine.Udf(step[2], step[3])
            except engine.CompileError as error:
                return step[1], str(error)
    return None


def _limit_cpu(budget: float) -> None:
    """End the process (SIGXCPU) once this request has used its budget and a second more of CPU time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft = math.ceil(used + budget) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main() -> None:
    """Serve requests from stdin until it closes."""
    context_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 128 * 1024 * 1024
    with contextlib.suppress(ValueError, OSError):  # a lower limit is already in force
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    stdin = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # nothing else may write to the frames' stream
    worker = Worker(out, context_bytes)
    while (request := read_frame(stdin)) is not None:
        worker.handle(request)


if __name__ == "__main__":
    main()
