"""Publish throughput: hedgepub's publishing styles against raw gRPC and the official client.

Every target publishes N messages of 100 bytes to the same local server (``hedgepub serve --in-memory
--no-rest``, a child process with its own interpreter), and **each measurement runs in a fresh Python
process** (this script with ``--child``): a client measured in a process that earlier ran other clients
inherits their threads, caches and heap, and raw gRPC measured that way was slower than in a process of its
own. The targets take turns round after round (the one that goes first rotates), so that they share the
machine's noise; each is summed up as its median with [min-max] over the rounds, beside its client CPU per
message (the whole child process, every thread, over the timed part) and the load average.

    python benchmarks/publish_throughput.py [--rounds 5] [--messages 100000] [--targets a,b,...]
    python benchmarks/publish_throughput.py --profile futures-100 [--profile raw-100]
    python benchmarks/publish_throughput.py --no-server --baseline-src ../other-checkout/src

Targets are ``STYLE-BATCH``: ``BATCH`` is the messages per request (``BatchSettings(max_messages=...)``, or
the raw request's size), 100 or ``--large-batch`` (1,000). The styles, as users publish:

* ``futures``: ``PublisherClient.publish`` for every message, the futures collected, then ``result()`` of
  each; ``futures-on`` the same with hedging on (1 s delay, never reached);
* ``callbacks``: one ``add_done_callback`` per future, as the official samples do, waiting for the last;
* ``async``: ``AsyncPublisherClient``, ``await asyncio.gather(*(publisher.publish(...) ...))``;
* ``threads``: ``--threads`` (8) threads sharing one ``PublisherClient``, each publishing its share in the
  ``futures`` style;
* ``many``: ``PublisherClient.publish_many`` with ``--many-chunk`` (1,000) messages per call, each call's
  future collected, then ``result()``;
* ``raw``: raw gRPC, the baseline: one ``PublishRequest`` of BATCH messages serialized up front and sent
  again and again by 4 concurrent callers on one ``grpc.aio`` channel (``server_ingest.py``'s), which is
  what a publisher would reach if building batches and handing out and resolving futures cost nothing;
* ``rawbuilt``: raw gRPC doing the least any publisher must do beyond ``raw``: each request built anew
  from the payloads (framed and joined: one copy, as ``publish_many`` builds it) and each response's
  message IDs read into a list of Python strings (what a publisher hands its caller); the same 4 callers.
  ``many`` against ``rawbuilt`` is the publisher's own cost, hedging, batching and futures, with the
  floor that the protocol sets for any Python publisher taken out;
* ``official``: google-cloud-pubsub's ``PublisherClient`` (its default batches of 100), futures collected.

Targets (exit status 1 when one is missed): every hedgepub style >= 0.85x raw gRPC at 100 messages per
request and >= 0.7x at 1,000; ``many`` >= 0.9x at both; hedging on / off >= 0.97x; threads / one thread
>= 0.95x; hedgepub >= 4x the official client.

``--profile TARGET`` runs that target once, in a fresh process, under ``cProfile`` (one profiler in the
publishing thread, one in the client's loop thread) and prints the functions that take the most time per
message, and the garbage collector's share: where the per-message time goes (``--profile raw-100`` beside
``--profile futures-100`` compares them). cProfile slows Python calls down, so read its figures as shares,
not as speeds.

``--baseline-src PATH`` (the ``src`` directory of another checkout, say of the main branch) runs every
hedgepub target a second time, as ``TARGET@base``, with that checkout's package, right after its
current run in every round; the summary gives each target's rate and CPU per message against its
baseline's, measured side by side (``--profile TARGET@base`` profiles the baseline). This is how a
change to the per-message path is judged on a busy machine.

With ``HEDGEPUB_BENCH_CHANNEL_POOL_SIZE=N`` in the environment, every hedgepub client is built with
``channel_pool_size=N`` (the connections per endpoint; unset: the default), so that runs with two sizes,
alternated, compare them.

With ``--no-server``, the hedgepub targets publish through an in-process transport that takes each
request's bytes and answers at once (no server, no network; see :class:`InstantTransport`): what is
measured is the client's own cost.

With ``--otel`` it measures OpenTelemetry's cost instead: hedgepub's sync client (hedging on, never
triggered) without OpenTelemetry importable, with it installed but off, on with the API's no-op providers,
and on with the SDK (spans batched to an exporter that drops them, metrics kept in memory); and, for
reference, the official client with its tracing on and the same SDK set-up. Each runs in a fresh child
process, so that all start equal. Target: installed but off >= 0.97x without.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

PROJECT = "bench-project"
PAYLOAD = b"x" * 100
HEDGE_DELAY = 1.0  # seconds; a healthy local server answers far sooner, so no hedge is sent
#: Messages each client publishes in its process before it is measured (the connection, the first calls).
WARM_UP = 2_000
#: Raw gRPC's concurrent callers, as the issue's comparison used.
RAW_IN_FLIGHT = 4
#: The publishing styles, in the order they are listed.
STYLES = ("futures", "futures-on", "callbacks", "async", "threads", "many", "raw", "rawbuilt", "official")


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """``hedgepub serve --in-memory --no-rest`` as a child process (``server_ingest.py``'s
    ``ServerProcess``); yields its address, also set in PUBSUB_EMULATOR_HOST.

    gRPC alone on the port: the REST front's relay process would take CPU from the client being
    measured on a small machine, and REST plays no part here. The command-line server rather than a
    ``LocalServer`` in a child process: a ``LocalServer`` keeps what is published to a topic without
    subscriptions (``keep_unsubscribed=True``, so that tests can read it back), which measured 20-25%
    fewer messages/s for the same client on 2026-12-01 and made the server, not the client, the
    bottleneck; the command-line server drops such messages, as the real service does.
    """
    from server_ingest import ServerProcess

    server = ServerProcess("memory", rest=False)
    server.start()
    try:
        os.environ["PUBSUB_EMULATOR_HOST"] = server.address  # official clients and child processes read it
        yield server.address
    finally:
        server.stop()


def create_topic(address: str, name: str) -> str:
    """Create topic ``name`` of the bench project on the server at ``address``; return its path."""
    from hedgepub.bench import AdminClient

    topic = f"projects/{PROJECT}/topics/{name}"
    with AdminClient(address) as admin:
        admin.create_topic(topic)
    return topic


#: CPU microseconds per message of the last _measure call (the whole process: every thread).
last_cpu_us_per_message = 0.0


def _measure(publish_all: Callable[[], int], messages: int) -> float:
    global last_cpu_us_per_message
    started, cpu_started = time.perf_counter(), time.process_time()
    published = publish_all()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if published != messages:
        raise RuntimeError(f"published {published} of {messages} messages")
    last_cpu_us_per_message = cpu / messages * 1e6
    return messages / elapsed


#: What a target's name ends with to run it from ``--baseline-src``'s checkout.
BASELINE_SUFFIX = "@base"


def split_target(name: str) -> tuple[str, int]:
    """``"futures-on-100"`` -> ``("futures-on", 100)`` (also for ``"futures-on-100@base"``)."""
    style, _, batch = name.removesuffix(BASELINE_SUFFIX).rpartition("-")
    if style not in STYLES or not batch.isdigit():
        raise SystemExit(f"unknown target {name!r}: STYLE-BATCH, STYLE one of {', '.join(STYLES)}")
    return style, int(batch)


class InstantTransport:
    """``--no-server``'s transport: takes the request's bytes, as gRPC does, and answers at once with one ID
    per message, counting the messages from the request's length (every message here is ``PAYLOAD``).

    No parsing and no copy, so that what is measured is the publisher's own work. (The test double
    ``ScriptedTransport`` parses every request into a protobuf object first, a cost of its own.)
    """

    ready = True

    def __init__(self, topic: str) -> None:
        from hedgepub._publisher.batch import data_head, request_overhead

        self._overhead = request_overhead(topic)
        self._framed = len(data_head(len(PAYLOAD))) + len(PAYLOAD)
        self._ids: dict[int, list[str]] = {}

    async def publish(self, request: bytes, metadata: object, timeout: float) -> list[str]:
        """One ID per message of ``request``."""
        count = (len(request) - self._overhead) // self._framed
        ids = self._ids.get(count)
        if ids is None:
            ids = self._ids[count] = [str(number) for number in range(count)]
        return ids

    def connected(self) -> bool:
        """Always "connected"."""
        return True

    def keep_connected(self) -> bool:
        """No connection to keep."""
        return False

    async def wait_ready(self, timeout: float) -> bool:
        """Always ready."""
        return True

    async def probe(self, timeout: float) -> bool:
        """Always answers."""
        return True

    async def close(self) -> None:
        """Nothing to close."""


# ---- the child: one target, one measurement, in a fresh process ----------------------------------------


class _Profiler:
    """``--profile``: cProfile in the publishing thread and in the client's loop thread, and the garbage
    collector's time; :meth:`report` prints each thread's top functions in microseconds per message."""

    def __init__(self) -> None:
        import cProfile

        self.main = cProfile.Profile()
        self.loop_profile: Any = None
        self.gc_seconds = 0.0
        self._gc_started = 0.0
        self._cprofile = cProfile

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_started

    def start(self, loop: Any = None) -> None:
        """Profile this thread, and ``loop``'s thread (a running asyncio loop in another thread) if given."""
        gc.callbacks.append(self._gc)
        if loop is not None:
            self.loop_profile = self._cprofile.Profile()
            ready = threading.Event()

            def enable() -> None:
                self.loop_profile.enable()
                ready.set()

            loop.call_soon_threadsafe(enable)
            ready.wait(10)
        self.main.enable()

    def stop(self, loop: Any = None) -> None:
        """Stop every profiler (the loop's on its own thread)."""
        self.main.disable()
        gc.callbacks.remove(self._gc)
        if loop is not None and self.loop_profile is not None:
            done = threading.Event()

            def disable() -> None:
                self.loop_profile.disable()
                done.set()

            loop.call_soon_threadsafe(disable)
            done.wait(10)

    def report(self, messages: int, out: io.TextIOBase, top: int = 18) -> None:
        """Print the top functions of each profiled thread by own time, in us per message."""
        import pstats

        print(f"garbage collector: {self.gc_seconds / messages * 1e6:.2f} us per message", file=out)
        for label, profile in (("publishing thread", self.main), ("loop thread", self.loop_profile)):
            if profile is None:
                continue
            stats = pstats.Stats(profile)
            rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
            total = sum(row[2] for _, row in rows)
            print(f"{label}: {total / messages * 1e6:.2f} us per message in profiled functions", file=out)
            print(f"  {'own us/msg':>10} {'calls/msg':>9}  function", file=out)
            for (filename, line, function), (_cc, calls, own, _cum, _callers) in rows[:top]:
                where = "/".join(filename.split(os.sep)[-2:])
                print(
                    f"  {own / messages * 1e6:>10.3f} {calls / messages:>9.3f}  {function} ({where}:{line})",
                    file=out,
                )


#: Set, every hedgepub client of a run gets ``channel_pool_size`` of this value (children inherit it).
POOL_SIZE_ENV = "HEDGEPUB_BENCH_CHANNEL_POOL_SIZE"


def _hedgepub_client(style: str, batch: int, topic: str, instant: bool) -> Any:
    from hedgepub import AsyncPublisherClient, BatchSettings, HedgingSettings, PublisherClient

    arguments: dict[str, Any] = {"batch_settings": BatchSettings(max_messages=batch)}
    if os.environ.get(POOL_SIZE_ENV):
        arguments["channel_pool_size"] = int(os.environ[POOL_SIZE_ENV])
    if style == "futures-on":
        arguments["hedging_settings"] = HedgingSettings(hedge_delay=HEDGE_DELAY)
    if instant:
        arguments["transport"] = InstantTransport(topic)
    return (AsyncPublisherClient if style == "async" else PublisherClient)(**arguments)


def _publish_futures(publisher: Any, topic: str, count: int) -> int:
    publish = publisher.publish
    futures = [publish(topic, PAYLOAD) for _ in range(count)]
    return sum(1 for future in futures if future.result())


def _publish_callbacks(publisher: Any, topic: str, count: int) -> int:
    """One ``add_done_callback`` per future, as the official samples do; the callback reads the result."""
    finished = threading.Event()
    counter = itertools.count(1)  # next() is atomic: callbacks may run on the loop and on this thread
    published = itertools.count(1)
    last = [0]

    def callback(future: Any) -> None:
        if future.result():
            last[0] = next(published)
        if next(counter) == count:
            finished.set()

    publish = publisher.publish
    for _ in range(count):
        publish(topic, PAYLOAD).add_done_callback(callback)
    finished.wait()
    return last[0]


def _publish_threads(publisher: Any, topic: str, count: int, threads: int) -> int:
    shares = [count // threads + (index < count % threads) for index in range(threads)]
    published: list[int] = []
    workers = [
        threading.Thread(
            target=lambda share=share: published.append(_publish_futures(publisher, topic, share))
        )
        for share in shares
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(published)


def _publish_many(publisher: Any, topic: str, count: int, chunk: int) -> int:
    messages = [PAYLOAD] * chunk
    calls = [
        publisher.publish_many(topic, messages[: min(chunk, count - start)])
        for start in range(0, count, chunk)
    ]
    return sum(len(call.result()) for call in calls)


def child(options: argparse.Namespace) -> dict[str, Any]:
    """Run one target once (in this fresh process) and return its figures."""
    style, batch = split_target(options.child)
    topic, count = options.topic, options.messages
    profiler = _Profiler() if options.profile_child else None
    if style == "raw":
        return _child_raw(options.address, topic, count, batch, profiler)
    if style == "rawbuilt":
        return _child_raw_built(options.address, topic, count, batch, profiler)
    if style == "official":
        return _child_official(topic, count, profiler)
    if style == "async":
        return _child_async(topic, count, batch, options.no_server, profiler)
    publisher = _hedgepub_client(style, batch, topic, options.no_server)
    publish: Callable[[int], int]
    if style == "callbacks":
        publish = lambda n: _publish_callbacks(publisher, topic, n)  # noqa: E731
    elif style == "threads":
        publish = lambda n: _publish_threads(publisher, topic, n, options.threads)  # noqa: E731
    elif style == "many":
        publish = lambda n: _publish_many(publisher, topic, n, options.many_chunk)  # noqa: E731
    else:
        publish = lambda n: _publish_futures(publisher, topic, n)  # noqa: E731
    try:
        publish(WARM_UP)  # the channel's connection and first calls, outside the measurement
        loop = publisher._runner.loop
        if profiler is not None:
            profiler.start(loop)
        rate = _measure(lambda: publish(count), count)
        if profiler is not None:
            profiler.stop(loop)
    finally:
        publisher.shutdown()
    return {
        "rate": rate,
        "cpu_us": last_cpu_us_per_message,
        "hedges": publisher.stats().hedges_sent,
        "profiler": profiler,
    }


def _child_async(
    topic: str, count: int, batch: int, instant: bool, profiler: _Profiler | None
) -> dict[str, Any]:
    import asyncio

    async def run() -> dict[str, Any]:
        publisher = _hedgepub_client("async", batch, topic, instant)

        async def publish_all(n: int) -> int:
            publish = publisher.publish
            ids = await asyncio.gather(*(publish(topic, PAYLOAD) for _ in range(n)))
            return sum(1 for message_id in ids if message_id)

        try:
            await publish_all(WARM_UP)
            started, cpu_started = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.start()
            published = await publish_all(count)
            if profiler is not None:
                profiler.stop()
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        finally:
            await publisher.shutdown()
        if published != count:
            raise RuntimeError(f"published {published} of {count} messages")
        return {"rate": count / elapsed, "cpu_us": cpu / count * 1e6, "hedges": publisher.stats().hedges_sent}

    figures = asyncio.run(run())
    figures["profiler"] = profiler
    return figures


def _child_raw(
    address: str, topic: str, count: int, batch: int, profiler: _Profiler | None
) -> dict[str, Any]:
    """Raw gRPC: one ``PublishRequest`` of ``batch`` messages serialized up front, sent ``count // batch``
    times by :data:`RAW_IN_FLIGHT` concurrent callers (``server_ingest.py``'s)."""
    import asyncio

    from server_ingest import build_request, publish_requests

    request = build_request(topic, batch, len(PAYLOAD))
    requests = max(1, count // batch)
    asyncio.run(publish_requests(address, max(1, WARM_UP // batch), RAW_IN_FLIGHT, request))  # warm-up
    if profiler is not None:
        profiler.start()
    run = asyncio.run(publish_requests(address, requests, RAW_IN_FLIGHT, request))
    if profiler is not None:
        profiler.stop()
    if run.messages != requests * batch:
        raise RuntimeError(f"raw gRPC: {run.messages} messages acknowledged of {requests * batch}")
    return {
        "rate": run.messages_per_second,
        "cpu_us": run.client_cpu_seconds / run.messages * 1e6,
        "hedges": 0,
        "profiler": profiler,
    }


def _child_raw_built(
    address: str, topic: str, count: int, batch: int, profiler: _Profiler | None
) -> dict[str, Any]:
    """``rawbuilt``: raw gRPC by :data:`RAW_IN_FLIGHT` concurrent callers, each request framed anew from
    ``batch`` payloads and each response's message IDs read into a list of Python strings."""
    import asyncio
    import time

    import grpc
    from google.pubsub_v1.types import pubsub as pubsub_types

    from hedgepub._publisher.batch import frame_data, topic_field
    from server_ingest import PUBLISH

    response_type = pubsub_types.PublishResponse.pb()
    payloads = [PAYLOAD] * batch
    head = topic_field(topic)

    async def publish_all(requests: int) -> tuple[int, float, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            publish = channel.unary_unary(PUBLISH, response_deserializer=response_type.FromString)
            remaining, acknowledged = requests, 0

            async def caller() -> None:
                nonlocal remaining, acknowledged
                while remaining > 0:
                    remaining -= 1
                    response = await publish(frame_data(payloads, head), timeout=120)
                    acknowledged += len(list(response.message_ids))

            started, cpu_started = time.perf_counter(), time.process_time()
            await asyncio.gather(*(caller() for _ in range(RAW_IN_FLIGHT)))
            return acknowledged, time.perf_counter() - started, time.process_time() - cpu_started

    requests = max(1, count // batch)
    asyncio.run(publish_all(max(1, WARM_UP // batch)))  # warm-up
    if profiler is not None:
        profiler.start()
    acknowledged, seconds, cpu = asyncio.run(publish_all(requests))
    if profiler is not None:
        profiler.stop()
    if acknowledged != requests * batch:
        raise RuntimeError(f"raw gRPC: {acknowledged} messages acknowledged of {requests * batch}")
    return {
        "rate": acknowledged / seconds,
        "cpu_us": cpu / acknowledged * 1e6,
        "hedges": 0,
        "profiler": profiler,
    }


def _child_official(topic: str, count: int, profiler: _Profiler | None) -> dict[str, Any]:
    """google-cloud-pubsub's PublisherClient (found through PUBSUB_EMULATOR_HOST), futures collected."""
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient()
    try:
        _publish_futures(publisher, topic, WARM_UP)
        if profiler is not None:
            profiler.start()
        rate = _measure(lambda: _publish_futures(publisher, topic, count), count)
        if profiler is not None:
            profiler.stop()
    finally:
        publisher.stop()
    return {"rate": rate, "cpu_us": last_cpu_us_per_message, "hedges": 0, "profiler": profiler}


def run_child(
    name: str, address: str, topic: str, options: argparse.Namespace, profile: bool = False
) -> dict[str, Any]:
    """Run target ``name`` in a fresh Python process; its figures (and, with ``profile``, its report)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--topic", topic]
    command += ["--address", address, "--messages", str(options.messages), "--threads", str(options.threads)]
    command += ["--many-chunk", str(options.many_chunk)]
    command += ["--no-server"] if options.no_server else []
    command += ["--profile-child"] if profile else []
    env = None
    if name.endswith(BASELINE_SUFFIX):
        if not options.baseline_src:
            raise SystemExit(f"target {name} needs --baseline-src")
        # The other checkout's package first on the path (this script's own directory stays first, for
        # server_ingest): the child imports hedgepub from there.
        path = [os.path.abspath(options.baseline_src), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(part for part in path if part)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"target {name} failed (exit {done.returncode}):\n{done.stderr}")
    *report, last = done.stdout.rstrip("\n").split("\n")
    figures: dict[str, Any] = json.loads(last)
    figures["report"] = "\n".join(report)
    return figures


# ---- the parent: rounds, medians, ratios ----------------------------------------------------------------


class _Rounds:
    """Each target's messages/s and CPU per message, round by round: the target that goes first rotates
    (so none always runs on a cold or a warm machine), and each run prints its line as it ends."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._width = max(len(name) for name in names)
        self._rates: dict[str, list[float]] = {name: [] for name in names}
        self._cpu: dict[str, list[float]] = {name: [] for name in names}

    def order(self, round_number: int) -> list[str]:
        """The targets in the order they run in round ``round_number``."""
        shift = round_number % len(self.names)
        return self.names[shift:] + self.names[:shift]

    def record(self, round_number: int, name: str, rate: float, cpu_us: float) -> None:
        """Keep one run's figures and print them."""
        from server_ingest import load_average

        self._rates[name].append(rate)
        self._cpu[name].append(cpu_us)
        print(
            f"round {round_number + 1} {name:>{self._width}}: {rate:>10,.0f} messages/s  "
            f"{cpu_us:6.2f} us CPU/message  (load {load_average()})",
            flush=True,
        )

    def medians(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each target's median messages/s, and its median CPU microseconds per message."""
        rates = {name: statistics.median(values) for name, values in self._rates.items()}
        cpu = {name: statistics.median(values) for name, values in self._cpu.items()}
        return rates, cpu

    def spreads(self, name: str) -> tuple[str, str]:
        """``median [min-max]`` of ``name``'s messages/s, and of its CPU microseconds per message."""
        from server_ingest import spread

        return spread(self._rates[name]), spread(self._cpu[name], ".2f")

    def ratio_spread(self, first: str, second: str) -> str:
        """The ratio of two targets' messages/s round by round (they ran in the same rounds), as
        ``median of the medians' ratio [min-max of the rounds' ratios]``."""
        ratios = [a / b for a, b in zip(self._rates[first], self._rates[second], strict=True)]
        median = statistics.median(self._rates[first]) / statistics.median(self._rates[second])
        return f"{median:.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


OTEL_VARIANTS = (
    ("without", False, False, False),
    ("off", True, False, False),
    ("on-noop", True, True, False),
    ("on-sdk", True, True, True),
    ("official-sdk", True, True, True),
)


def _otel_child(
    variant: str, address: str, topic: str, messages: int, result: multiprocessing.connection.Connection
) -> None:
    _name, importable, enabled, sdk = next(entry for entry in OTEL_VARIANTS if entry[0] == variant)
    if not importable:
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # as if the extra were not installed
    os.environ["PUBSUB_EMULATOR_HOST"] = address
    from hedgepub import HedgingSettings, PublisherClient

    arguments: dict[str, object] = {}
    if enabled:
        arguments["enable_open_telemetry"] = True
    if sdk:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        class Dropping(SpanExporter):
            def export(self, spans: object) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(Dropping()))
        arguments["tracer_provider"] = tracer_provider
        arguments["meter_provider"] = MeterProvider(metric_readers=[InMemoryMetricReader()])
    publisher: Any
    if variant == "official-sdk":
        from google.cloud import pubsub_v1
        from opentelemetry import metrics, trace

        trace.set_tracer_provider(arguments["tracer_provider"])  # type: ignore[arg-type]  # it reads the global one
        metrics.set_meter_provider(arguments["meter_provider"])  # type: ignore[arg-type]
        options = pubsub_v1.types.PublisherOptions(enable_open_telemetry_tracing=True)
        publisher = pubsub_v1.PublisherClient(publisher_options=options)
        publisher.shutdown = publisher.stop
    else:
        publisher = PublisherClient(hedging_settings=HedgingSettings(hedge_delay=HEDGE_DELAY), **arguments)  # type: ignore[arg-type]

    def publish_all(count: int) -> int:
        publish = publisher.publish
        futures = [publish(topic, PAYLOAD) for _ in range(count)]
        return sum(1 for future in futures if future.result())

    try:
        publish_all(2_000)  # warm-up: channel, code paths
        rate = _measure(lambda: publish_all(messages), messages)
        result.send((rate, last_cpu_us_per_message))
    finally:
        publisher.shutdown()


def otel_comparison(
    address: str,
    context: multiprocessing.context.SpawnContext,
    messages: int,
    rounds: int,
    variants: list[str] | None = None,
) -> int:
    """The --otel run: every variant once per round in its own child process; medians and ratios."""
    chosen = set(variants or ()) | {"without", "off"} if variants else {name for name, *_ in OTEL_VARIANTS}
    unknown = chosen - {name for name, *_ in OTEL_VARIANTS}
    if unknown:
        raise SystemExit(f"unknown --otel-variants: {', '.join(sorted(unknown))}")
    names = [name for name, *_ in OTEL_VARIANTS if name in chosen]
    runs = _Rounds(names)
    for round_number in range(rounds):
        for name in runs.order(round_number):
            receive, send = context.Pipe(duplex=False)
            topic = create_topic(address, f"otel-{round_number}-{name}")
            child = context.Process(target=_otel_child, args=(name, address, topic, messages, send))
            child.start()
            rate, cpu_us = receive.recv()
            child.join(60)
            runs.record(round_number, name, rate, cpu_us)
    medians, cpu_medians = runs.medians()
    without = medians["without"]
    print()
    print(
        f"{messages:,} messages of {len(PAYLOAD)} bytes, hedging on (never triggered), "
        f"{rounds} rounds (medians)"
    )
    for name in names:
        print(
            f"{name:>12}: {medians[name]:>10,.0f} messages/s  {medians[name] / without:>5.2f}x of without  "
            f"{cpu_medians[name]:>7.1f} us CPU/message  {cpu_medians[name] / cpu_medians['without']:>5.2f}x"
        )
    off_ratio = medians["off"] / without
    print(
        f"installed but off / without: {off_ratio:.2f}x  (target >= 0.97x)  "
        f"{'ok' if off_ratio >= 0.97 else 'MISSED'}"
    )
    print(
        f"CPU per message, installed but off / without: {cpu_medians['off'] / cpu_medians['without']:.2f}x "
        "(less sensitive to a busy machine than messages/s)"
    )
    return 0 if off_ratio >= 0.97 else 1


LABELS = {
    "futures": "sync, futures then result()",
    "futures-on": "sync, futures, hedging on",
    "callbacks": "sync, add_done_callback per future",
    "async": "asyncio, await gather(publish...)",
    "threads": "sync, {threads} threads share one client",
    "many": "publish_many, {chunk:,} per call",
    "raw": f"raw gRPC, pre-built, {RAW_IN_FLIGHT} in flight",
    "rawbuilt": f"raw gRPC, built, IDs read, {RAW_IN_FLIGHT} in flight",
    "official": "google-cloud-pubsub, futures",
}


def default_targets(large: int, no_server: bool) -> list[str]:
    """The targets run without ``--targets``: every style at 100 and at ``large`` per request (the
    official client at its default 100 only); without a server, the hedgepub styles only."""
    from hedgepub import PublisherClient

    styles = [style for style in STYLES if style != "official"]
    if not hasattr(PublisherClient, "publish_many"):
        styles.remove("many")
    if no_server:
        styles.remove("raw")
        styles.remove("rawbuilt")
    names = [f"{style}-{batch}" for batch in (100, large) for style in styles]
    return names if no_server else [*names, "official-100"]


def checks(names: list[str], large: int, threads: int) -> list[tuple[str, str, str, float]]:
    """The ratios to print and their targets, among those whose targets both ran."""
    found: list[tuple[str, str, str, float]] = []
    for batch in (100, large):
        raw = f"raw-{batch}"
        for style in ("futures", "futures-on", "callbacks", "async", "threads", "many"):
            target = 0.9 if style == "many" else (0.85 if batch == 100 else 0.7)
            found.append((f"{style} / raw gRPC, {batch}", f"{style}-{batch}", raw, target))
        found.append((f"hedging on / off, {batch}", f"futures-on-{batch}", f"futures-{batch}", 0.97))
        found.append((f"{threads} threads / 1, {batch}", f"threads-{batch}", f"futures-{batch}", 0.95))
        found.append((f"publish_many / publish, {batch}", f"many-{batch}", f"futures-{batch}", 0.0))
        found.append((f"raw built / raw gRPC, {batch}", f"rawbuilt-{batch}", raw, 0.0))
        found.append((f"publish_many / raw built, {batch}", f"many-{batch}", f"rawbuilt-{batch}", 0.0))
    found.append(("hedgepub / official, 100", "futures-100", "official-100", 4.0))
    return [check for check in found if check[1] in names and check[2] in names]


def profile(options: argparse.Namespace, address: str, topic_of: Callable[[str], str]) -> int:
    """``--profile``: each named target once, under cProfile, in a fresh process."""
    for name in options.profile:
        figures = run_child(name, address, topic_of(f"profile-{name}"), options, profile=True)
        print(
            f"== {name}: {figures['rate']:,.0f} messages/s under the profiler, "
            f"{figures['cpu_us']:.2f} us CPU/message"
        )
        print(figures["report"], flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print messages/s and ratios; exit status 1 when a target is missed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per target per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs every target once)")
    parser.add_argument("--targets", default=None, help="comma-separated STYLE-BATCH targets (default: all)")
    parser.add_argument("--threads", type=int, default=8, help="threads sharing one client in 'threads'")
    parser.add_argument("--many-chunk", type=int, default=1000, help="messages per publish_many call")
    parser.add_argument("--large-batch", type=int, default=1000, help="the large messages-per-request size")
    parser.add_argument(
        "--no-server",
        action="store_true",
        help="hedgepub only, through a transport that answers at once: the client's own cost",
    )
    parser.add_argument(
        "--profile", action="append", metavar="TARGET", help="profile TARGET (repeatable) instead of rounds"
    )
    parser.add_argument(
        "--baseline-src",
        metavar="PATH",
        help="also run every hedgepub target with the hedgepub package of another checkout's src "
        "directory (as TARGET@base, beside TARGET in every round) and compare them",
    )
    parser.add_argument(
        "--otel", action="store_true", help="measure OpenTelemetry's cost (off, on) instead; see above"
    )
    parser.add_argument(
        "--otel-variants",
        default=None,
        help="with --otel, the variants to run, comma-separated (without and off always run): "
        + ",".join(name for name, *_ in OTEL_VARIANTS),
    )
    # The child's side (this script in a fresh process, run by the parent).
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        figures = child(options)
        profiler = figures.pop("profiler", None)
        if profiler is not None:
            profiler.report(options.messages, sys.stdout)
        print(json.dumps(figures), flush=True)
        return 0
    if options.otel:
        context = multiprocessing.get_context("spawn")
        with local_server() as address:
            variants = options.otel_variants.split(",") if options.otel_variants else None
            return otel_comparison(address, context, options.messages, options.rounds, variants)
    large = options.large_batch
    names = options.targets.split(",") if options.targets else default_targets(large, options.no_server)
    if options.baseline_src:
        # Each hedgepub target beside its baseline, so that the two share the machine's noise.
        names = [
            paired
            for name in names
            for paired in (
                (name,)
                if split_target(name)[0] in ("raw", "rawbuilt", "official")
                else (name, name + BASELINE_SUFFIX)
            )
        ]
    for name in names + (options.profile or []):
        split_target(name)

    from server_ingest import load_average

    with contextlib.ExitStack() as stack:
        if options.no_server:
            address = ""
            topic_of = f"projects/{PROJECT}/topics/{{}}".format
        else:
            address = stack.enter_context(local_server())

            def topic_of(name: str) -> str:
                # "@" is not allowed in a topic ID: a baseline's topic is TARGET-base.
                return create_topic(address, name.replace(BASELINE_SUFFIX, "-base"))

        if options.profile:
            return profile(options, address, topic_of)
        load_before = load_average()
        runs = _Rounds(names)
        hedges = 0
        for round_number in range(options.rounds):
            for name in runs.order(round_number):
                figures = run_child(name, address, topic_of(f"round-{round_number}-{name}"), options)
                hedges += figures["hedges"]
                runs.record(round_number, name, figures["rate"], figures["cpu_us"])

    rates, cpus = runs.medians()
    print()
    print(
        f"{options.messages:,} messages of {len(PAYLOAD)} bytes per target, each run in a fresh process, "
        f"{options.rounds} rounds (medians [min-max]); load average {load_before} before, "
        f"{load_average()} after"
    )
    for name in names:
        style, _batch = split_target(name)
        label = LABELS[style].format(threads=options.threads, chunk=options.many_chunk)
        rate_text, cpu_text = runs.spreads(name)
        print(f"{name:>16}  {label:<42} {rate_text:>30} msg/s  {cpu_text:>20} us CPU/msg")
    print(f"hedges sent: {hedges}")
    for name in names:
        base = name + BASELINE_SUFFIX
        if base in rates:
            print(
                f"{name:>16} / its baseline: {runs.ratio_spread(name, base):>20} by rate, "
                f"{cpus[base] / cpus[name]:.2f}x by CPU per message "
                f"({cpus[base]:.2f} -> {cpus[name]:.2f} us)"
            )
    met = True
    for label, first, second, target in checks(names, large, options.threads):
        value = rates[first] / rates[second]
        verdict = "" if not target else ("ok" if value >= target else "MISSED")
        met &= value >= target
        goal = f"(target >= {target:g}x)" if target else ""
        print(
            f"{label:<32}: {runs.ratio_spread(first, second):>20}  {goal:<17} {verdict:<6}  "
            f"by CPU per message: {cpus[second] / cpus[first]:.2f}x"
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
