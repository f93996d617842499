"""The bench's network scenarios: packet loss, a dead connection and a lost SYN, on real TCP.

Three publishers run the same schedule (see :mod:`hedgepub.bench._experiment`): ``unhedged`` (one
connection), ``same_connection`` (one connection, hedging: the hedge rides the original's TCP
connection) and ``other_connection`` (``channel_pool_size=2``, hedging: the hedge goes on the other
one). Nothing is injected in the server; the fault is on each publisher's path to it:

- ``packet-loss``: packets (kernel) or segments (relay) lost with probability ``loss``, both ways, from
  the measured period on (the warm-up runs without loss);
- ``dead-connection``: a quarter into the measured period, each publisher's busiest connection (the one
  its originals ride) black-holed for ``blackhole`` seconds: nothing delivered, nothing refused;
- ``lost-syn``: connection set-ups lost with probability ``syn_loss`` from the start, with no warm-up,
  so the first publishes need a connection.

Where the fault comes from (:func:`resolve_harness`): the kernel's packet filter where it works (Linux,
root: :class:`~hedgepub.testing.network.kernel.KernelNetwork`), else the userspace relay
(:class:`~hedgepub.testing.FaultRelay`). The relay runs in this process, one per publisher in front of
one server. The kernel needs the publishers inside a network namespace: :func:`run_in_namespace` makes
one, runs the experiment in a child process inside it (``python -m hedgepub.bench._network``, which
reports its progress and its result as JSON lines) and deletes the namespace; inside, each publisher has
a server of its own, so that its connections are told apart by port.

The servers are ``hedgepub serve --in-memory --no-rest`` processes, not in the bench's process: three
publishers and three servers on one interpreter made the schedule itself late by hundreds of ms on a busy
machine, which is not the network's doing. So duplicates on the server are not counted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hedgepub.bench._config import BenchConfig, PublisherSpec

if TYPE_CHECKING:
    from hedgepub.bench._experiment import BenchProgress, BenchRun

#: Set in the child process that runs inside the namespace: the namespace's name.
INSIDE_VARIABLE = "HEDGEPUB_BENCH_NETNS"
#: Seconds a lost SYN costs in the relay (the initial retransmission timeout).
SYN_DELAY = 1.0


def resolve_harness(choice: str) -> tuple[str, str | None]:
    """``(harness, why)`` for ``network=choice``: ``kernel`` or ``relay``, and why the relay was used.

    Raises:
        ValueError: ``kernel`` was asked for and cannot run here (the reason is measured).
    """
    if choice == "relay":
        return "relay", "asked for"
    if os.environ.get(INSIDE_VARIABLE):
        return "kernel", None
    from hedgepub.testing.network.kernel import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return "kernel", None
    if choice == "kernel":
        raise ValueError(f"the kernel harness cannot run here: {reason}")
    return "relay", reason


class NetworkPlan:
    """Each publisher's path to its server, and when the scenario's fault hits it."""

    def __init__(self, config: BenchConfig, harness: str, why: str | None) -> None:
        self.config = config
        self.harness = harness
        self.why = why
        self._specs = config.publishers()
        self._relays: dict[str, Any] = {}
        self._servers: dict[str, Any] = {}
        self._network: Any = None
        self._timers: list[asyncio.TimerHandle] = []
        self._blackholed: dict[str, int] = {}
        self._processes: list[subprocess.Popen[str]] = []

    # set-up ----------------------------------------------------------------------------------------------

    def open(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Start the servers (and relays); returns the servers, ``primary`` first."""
        stack.callback(self.close)
        names = [spec.name for spec in self._specs]
        command = [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--no-rest", "--port", "0"]
        if self.config.dedup_hedges:
            command.append("--dedup-hedges")
        if self.harness == "kernel":
            from hedgepub.testing.network.kernel import KernelNetwork

            self._network = KernelNetwork.joined(os.environ[INSIDE_VARIABLE])
        # the kernel tells a publisher's connections apart by its server's port
        for index, name in enumerate(names if self.harness == "kernel" else names[:1]):
            key = "primary" if index == 0 else name
            serve = self._network.serve if self._network is not None else self._serve
            self._servers[key] = ServerProcess(serve(command))
        if self._network is None:
            from hedgepub.testing import FaultRelay

            syn = self.config.syn_loss if self.config.scenario == "lost-syn" else 0.0
            upstream = self._servers["primary"].address
            for index, name in enumerate(names):
                self._relays[name] = FaultRelay(
                    upstream=upstream,
                    seed=self.config.seed + index,
                    syn_delay_probability=syn,
                    syn_delay=SYN_DELAY,
                ).start()
        return dict(self._servers)

    def _serve(self, command: list[str]) -> str:
        from hedgepub.testing.network.kernel import READY_PREFIX

        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._processes.append(process)
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"{' '.join(command)} did not start: {line!r}")
        return line[len(READY_PREFIX) :]

    def _server_of(self, name: str) -> Any:
        return self._servers.get(name, self._servers["primary"])

    def _ports(self) -> dict[str, int]:
        return {spec.name: int(self._server_of(spec.name).address.rsplit(":", 1)[1]) for spec in self._specs}

    def endpoint(self, spec: PublisherSpec) -> str:
        """Where publisher ``spec`` connects."""
        if spec.name in self._relays:
            return str(self._relays[spec.name].address)
        return str(self._server_of(spec.name).address)

    def endpoint_names(self) -> dict[str, str]:
        """Every publisher's endpoint address, named ``primary`` (each publisher has one endpoint)."""
        return {self.endpoint(spec): "primary" for spec in self._specs}

    # faults ----------------------------------------------------------------------------------------------

    def before_clients(self) -> None:
        """The topics are made, no publisher has connected: SYN loss from now on (``lost-syn``; the relay's
        set-up delays are drawn per connection from the start, and the bench's admin connects to the
        server directly)."""
        if self._network is not None and self.config.scenario == "lost-syn":
            for port in set(self._ports().values()):
                self._network.set_syn_loss(self.config.syn_loss, port=port)

    def measuring(self) -> None:
        """The warm-up is over: apply the loss, or schedule the black hole a quarter into the measured
        period."""
        config = self.config
        loop = asyncio.get_running_loop()
        if config.scenario == "packet-loss":
            if self._network is not None:
                for port in set(self._ports().values()):
                    self._network.set_loss(config.loss, port=port)
            for relay in self._relays.values():
                relay.set_loss(config.loss)
        elif config.scenario == "dead-connection":
            at = config.warmup_seconds + config.expected_seconds() / 4
            self._timers.append(loop.call_later(at, self._start_blackhole))

    def _start_blackhole(self) -> None:
        seconds = self.config.blackhole
        for name, relay in self._relays.items():
            live = [info for info in relay.connections if not info.closed]
            if live:
                busiest = max(live, key=lambda info: info.bytes_up)
                relay.blackhole(seconds, connections=busiest.index)
                self._blackholed[name] = busiest.client[1]
        if self._network is not None:
            from hedgepub.testing.network.kernel import bytes_sent_by_client_port

            for name, port in self._ports().items():
                sent = bytes_sent_by_client_port(port)
                if sent:
                    client_port = max(sent, key=lambda key: sent[key])
                    self._network.blackhole(client_port, seconds=seconds)
                    self._blackholed[name] = client_port

    def describe(self) -> dict[str, Any]:
        """The ``config.network`` entry of ``results.json``: the harness, why, and what the fault did."""
        entry: dict[str, Any] = {"harness": self.harness}
        if self.why is not None:
            entry["why"] = self.why
        if self._relays:
            entry["losses"] = {
                name: sum(info.losses_up + info.losses_down for info in relay.connections)
                for name, relay in self._relays.items()
            }
            entry["syn_delayed"] = {
                name: sum(info.syn_delayed for info in relay.connections)
                for name, relay in self._relays.items()
            }
        if self._network is not None and self.config.scenario != "dead-connection":
            entry["packets_dropped"] = sum(
                int(line.split()[0]) for line in self._network.rules().splitlines() if " DROP " in line
            )
        if self.config.scenario == "dead-connection":
            entry["blackholed_client_port"] = dict(self._blackholed)
        return entry

    def close(self) -> None:
        """Stop the timers and relays, remove the kernel rules."""
        for timer in self._timers:
            timer.cancel()
        for relay in self._relays.values():
            relay.close()
        self._relays.clear()
        if self._network is not None:
            self._network.close()  # its servers too
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self._processes.clear()


@dataclasses.dataclass(frozen=True)
class ServerProcess:
    """A ``hedgepub serve`` process of the plan: its address (the plan stops it)."""

    address: str


# The kernel harness: the experiment in a child process inside a namespace ------------------------------


async def run_in_namespace(config: BenchConfig, progress: BenchProgress) -> BenchRun:
    """Make a namespace, run ``config`` in a child process inside it, delete it; returns the child's run.

    Ctrl-C reaches the child too (it is in the terminal's process group), which ends its measured period
    and reports what it measured; the parent waits for that.
    """
    from hedgepub.bench._experiment import BenchInterrupted
    from hedgepub.testing.network.kernel import KernelNetwork, default_label

    with KernelNetwork(f"{default_label()}-bench") as network:
        command = network.command([sys.executable, "-m", "hedgepub.bench._network"])
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, INSIDE_VARIABLE: network.name},
            limit=2**30,  # the result line carries every latency
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(_config_to_json(config)).encode() + b"\n")
        await process.stdin.drain()
        process.stdin.close()
        result: dict[str, Any] | None = None
        try:
            result = await _follow(process.stdout, progress)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and sys.version_info >= (3, 11):
                current.uncancel()
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
            result = await asyncio.wait_for(_follow(process.stdout, progress), 120.0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                if process.returncode is None and result is None:
                    process.kill()
            await process.wait()
    if result is None or "error" in result:
        message = (result or {}).get("error", f"exit code {process.returncode}")
        raise RuntimeError(f"the bench inside the network namespace failed: {message}")
    if "interrupted" in result and "document" not in result:
        raise BenchInterrupted(result["interrupted"])
    return _run_from_json(result)


async def _follow(stream: asyncio.StreamReader, progress: BenchProgress) -> dict[str, Any] | None:
    """Relay the child's progress lines; return its result line (``None`` if it ended without one)."""
    async for raw in stream:
        try:
            message = json.loads(raw)
        except ValueError:
            continue  # not one of ours
        if not isinstance(message, dict):
            continue
        if "phase" in message:
            progress.phase(str(message["phase"]), message.get("total"))
        elif "advance" in message:
            progress.advance(int(message["advance"]))
        else:
            return message
    return None


def _config_to_json(config: BenchConfig) -> dict[str, Any]:
    entry = dataclasses.asdict(config)
    entry["hedge_delays"] = list(config.hedge_delays)
    return entry


def _config_from_json(entry: Mapping[str, Any]) -> BenchConfig:
    fields = {field.name for field in dataclasses.fields(BenchConfig)}
    settings = {key: value for key, value in entry.items() if key in fields}
    settings["hedge_delays"] = tuple(settings.get("hedge_delays", ()))
    return BenchConfig(**settings)


def _run_from_json(result: Mapping[str, Any]) -> BenchRun:
    from hedgepub.bench._experiment import BenchRun
    from hedgepub.bench._report import PublisherResult

    document = result["document"]
    results = {}
    for name, entry in document["results"].items():
        values: dict[str, Any] = {
            key: math.nan if value is None and key.endswith("_ms") else value for key, value in entry.items()
        }
        if name == "unhedged":
            values["hedge_delay_ms"] = None
        results[name] = PublisherResult(**values)
    samples = document.get("samples", {})
    return BenchRun(
        document=document,
        latencies_ms={name: list(samples.get(name, {}).get("latency_ms", [])) for name in results},
        results=results,
        max_schedule_lag_ms=float(result.get("max_schedule_lag_ms", 0.0)),
        missing=dict(result.get("missing", {})),
        interrupted=bool(result.get("interrupted", False)),
    )


class _LineProgress:
    """The child's progress, as JSON lines on stdout (advances gathered, at most one line per 100)."""

    def __init__(self) -> None:
        self._pending = 0

    def _emit(self, message: Mapping[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    def phase(self, description: str, total: int | None) -> None:
        self.flush()
        self._emit({"phase": description, "total": total})

    def advance(self, steps: int = 1) -> None:
        self._pending += steps
        if self._pending >= 100:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._emit({"advance": self._pending})
            self._pending = 0


def _inside_main() -> int:
    """The child inside the namespace: the config on stdin, progress and the result on stdout."""
    from hedgepub.bench._experiment import BenchInterrupted, run_bench

    if not os.environ.get(INSIDE_VARIABLE):
        print(json.dumps({"error": f"run by run_in_namespace only ({INSIDE_VARIABLE} is not set)"}))
        return 2
    progress = _LineProgress()
    try:
        config = _config_from_json(json.loads(sys.stdin.readline()))
        run = asyncio.run(run_bench(config, progress))
    except (BenchInterrupted, KeyboardInterrupt) as error:
        progress.flush()
        print(json.dumps({"interrupted": str(error) or "interrupted"}), flush=True)
        return 130
    except Exception as error:  # reported to the parent, which raises it there
        progress.flush()
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1
    progress.flush()
    result = {
        "document": run.document,
        "max_schedule_lag_ms": run.max_schedule_lag_ms,
        "missing": run.missing,
        "interrupted": run.interrupted,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_inside_main())
