"""The sandbox: a pool of worker processes that run message transforms for the server.

JavaScript UDFs are code a caller sends; run inside the server, one could take it down (QuickJS can
crash on a heap exhausted inside a built-in) or stall it (a regular expression that backtracks does not
stop at the engine's time limit). So they run in :data:`WORKERS` worker processes (:mod:`.udf_worker`),
spoken to over pipes from the event loop (asyncio streams: nothing blocks it), with limits enforced from
outside the engine:

- **CPU time**: each call of a UDF :data:`~.udf_engine.CALL_SECONDS`, and each request
  (the messages of one Publish or one delivery) :data:`REQUEST_SECONDS` together; the worker ends a
  request whose budget is spent (the rest of its messages are not run), and ``RLIMIT_CPU`` ends a
  worker that keeps computing past it.
- **Memory**: ``RLIMIT_AS`` per worker, a heap limit per context, and a bound in bytes on the contexts
  a worker keeps (:data:`CONTEXT_BYTES`, least recently used dropped first).
- **Silence**: a worker that answers nothing for :data:`SILENCE_SECONDS` is killed.

A worker that dies (a crash, a limit) fails the message it was running and nothing else; the messages
of the request after it are not run (:data:`NOT_RUN`), and the next request gets a new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import pickle
import signal
import struct
import sys
from collections.abc import Sequence
from typing import Any

from hedgepub.server._pubsub import udf_engine

logger = logging.getLogger("hedgepub.server")

__all__ = [
    "CONTEXT_BYTES",
    "NOT_RUN",
    "REQUEST_SECONDS",
    "SILENCE_SECONDS",
    "WORKERS",
    "Sandbox",
]

#: Worker processes of a server (started when a transform first runs).
WORKERS = 2
#: CPU time the messages of one request may take together, in seconds.
REQUEST_SECONDS = 2.0
#: A worker silent for this long (wall clock) while it has a request is killed.
SILENCE_SECONDS = 12.0
#: Bytes of JavaScript heap the contexts kept by all workers may hold together (estimated).
CONTEXT_BYTES = 256 * 1024 * 1024
#: Largest answer frame taken from a worker.
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: The outcome of a message that was not run (the request's budget was spent first, or its worker died
#: on an earlier message): ``("not run", why)``.
NOT_RUN = "not run"

_HEADER = struct.Struct(">I")
_READ_BYTES = 1 << 20
_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "udf_worker.py")


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a worker's answer can name no class or function to call."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a worker's answer may not name {module}.{name}")


def _loads(body: bytes) -> Any:
    return _PlainUnpickler(io.BytesIO(body)).load()


class WorkerDied(Exception):
    """The worker running a request died or was killed; the text says how."""


class _Process:
    """One worker process, started on demand, and its pipes; one request at a time (``lock``)."""

    def __init__(self, context_bytes: int) -> None:
        self._context_bytes = context_bytes
        self._process: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()
        #: Bytes read from the worker and not yet taken as frames.
        self._buffer = bytearray()
        #: Keys of the chains this worker keeps (approximately: it may have dropped some for room).
        self.keys: set[Any] = set()

    async def _started(self) -> asyncio.subprocess.Process:
        process = self._process
        if process is None or process.returncode is not None:
            process = self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                _WORKER_SCRIPT,
                str(self._context_bytes),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=MAX_FRAME_BYTES,
            )
            self.keys.clear()
            self._buffer.clear()
        return process

    @property
    def pid(self) -> int | None:
        """The worker's process ID while it runs."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    async def send(self, value: Any) -> None:
        """Write a request frame (the lock held)."""
        process = await self._started()
        assert process.stdin is not None
        body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            process.stdin.write(_HEADER.pack(len(body)) + body)
            await asyncio.wait_for(process.stdin.drain(), SILENCE_SECONDS)
        except (TimeoutError, OSError) as error:
            raise await self._died(f"could not be written to ({error or 'timed out'})") from None

    async def receive(self) -> Any:
        """The next answer frame (the lock held); :class:`WorkerDied` if the worker ends or is silent.

        Reads what the pipe holds in chunks and takes the frames from them, so that the many small
        frames of a request (one a message) cost one read and one timer a chunk, not two a frame."""
        process = self._process
        assert process is not None and process.stdout is not None
        buffer = self._buffer
        try:
            while True:
                if len(buffer) >= _HEADER.size:
                    (size,) = _HEADER.unpack_from(buffer)
                    if size > MAX_FRAME_BYTES:
                        raise await self._died(f"sent a frame of {size} bytes")
                    end = _HEADER.size + size
                    if len(buffer) >= end:
                        body = bytes(buffer[_HEADER.size : end])
                        del buffer[:end]
                        return _loads(body)
                chunk = await asyncio.wait_for(process.stdout.read(_READ_BYTES), SILENCE_SECONDS)
                if not chunk:
                    raise await self._died("")
                buffer += chunk
        except TimeoutError:
            raise await self._died(f"answered nothing for {SILENCE_SECONDS:g} s and was stopped") from None
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            raise await self._died("") from None

    async def _died(self, how: str) -> WorkerDied:
        process, self._process = self._process, None
        self.keys.clear()
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                if process.returncode is None and how:
                    process.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), SILENCE_SECONDS)
            code = process.returncode
            if not how:
                how = _ended(code)
        logger.warning("A transforms sandbox worker %s; it is restarted for the next request.", how)
        return WorkerDied(how)

    async def close(self) -> None:
        """End the worker (its stdin closed; killed if it does not end at once)."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 1.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def _ended(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        number = -code
        if number == signal.SIGXCPU:
            return f"used more than its CPU time budget of {REQUEST_SECONDS:g} s and was stopped (SIGXCPU)"
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        return f"crashed ({name})"
    return f"exited with status {code}"


class Sandbox:
    """The worker pool of one server: run chains on messages, validate UDFs, forget resources."""

    def __init__(self, workers: int = WORKERS, context_bytes: int = CONTEXT_BYTES) -> None:
        self._workers = [_Process(context_bytes // workers) for _ in range(workers)]
        self._free = asyncio.Condition()
        self._closed = False

    async def _acquire(self, key: Any) -> _Process:
        """A free worker, the one that keeps ``key``'s chain if it is free."""
        async with self._free:
            while True:
                if self._closed:
                    raise WorkerDied("the server is stopping")
                free = [worker for worker in self._workers if not worker.lock.locked()]
                if free:
                    chosen = next((worker for worker in free if key in worker.keys), free[0])
                    await chosen.lock.acquire()
                    return chosen
                await self._free.wait()

    async def _release(self, worker: _Process) -> None:
        worker.lock.release()
        async with self._free:
            self._free.notify()

    async def run(
        self,
        key: tuple[str, str] | None,
        steps: list[udf_engine.Step],
        messages: Sequence[tuple[bytes, dict[str, str], dict[str, str]]],
        trace: bool = False,
        budget: float = REQUEST_SECONDS,
    ) -> list[list[tuple[int, udf_engine.Outcome]]]:
        """Each message's step outcomes (see ``Chain.run``); a message not run has ``[(-1, (NOT_RUN,
        why))]``, and the one a worker died on ``[(index, ("failed", why))]`` (index -1: not known)."""
        results: list[list[tuple[int, udf_engine.Outcome]]] = []
        try:
            worker = await self._acquire(key)
        except WorkerDied as error:
            return [[(-1, (NOT_RUN, str(error)))] for _ in messages]
        try:
            await worker.send(("run", key, steps, list(messages), trace, budget))
            if key is not None:
                worker.keys.add(key)
            while True:
                answer = await worker.receive()
                if answer[0] == "result":
                    results.append(answer[2])
                elif answer[0] == "spent":
                    why = f"the request's CPU time budget for transforms ({budget:g} s) was spent first"
                    results.extend([(-1, (NOT_RUN, why))] for _ in messages[len(results) :])
                elif answer[0] == "done":
                    break
        except WorkerDied as error:
            if len(results) < len(messages):
                results.append([(-1, ("failed", f"the transforms sandbox worker {error}"))])
            why = f"an earlier message's transforms stopped their worker ({error})"
            results.extend([(-1, (NOT_RUN, why))] for _ in messages[len(results) :])
        finally:
            await self._release(worker)
        return results

    async def validate(self, steps: list[udf_engine.Step]) -> tuple[int, str] | None:
        """``(index, reason)`` of the first UDF of ``steps`` that does not compile, else ``None``."""
        worker = await self._acquire(None)
        try:
            await worker.send(("validate", steps))
            answer = await worker.receive()
            return answer[1]
        except WorkerDied as error:
            index = next((step[1] for step in steps if step[0] == "udf"), 0)
            return index, f"javascript_udf.code does not run: the transforms sandbox worker {error}"
        finally:
            await self._release(worker)

    async def forget(self, resource: str) -> None:
        """Drop the chains ``resource`` keeps in the workers (it was deleted)."""
        for worker in self._workers:
            if not any(key[0] == resource for key in worker.keys):
                continue
            await worker.lock.acquire()
            try:
                worker.keys = {key for key in worker.keys if key[0] != resource}
                if worker.pid is not None:
                    with contextlib.suppress(WorkerDied):
                        await worker.send(("forget", resource))
            finally:
                await self._release(worker)

    def worker_pids(self) -> list[int]:
        """Process IDs of the workers running now (for a look at their memory)."""
        return [worker.pid for worker in self._workers if worker.pid is not None]

    async def close(self) -> None:
        """End the workers."""
        self._closed = True
        async with self._free:
            self._free.notify_all()
        for worker in self._workers:
            await worker.close()
