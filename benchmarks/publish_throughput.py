"""Publish throughput: hedgepub's sync client (hedging off and on) against the official publisher.

Every client publishes N messages of 100 bytes with default batch settings to the same local server
(``hedgepub serve --in-memory --no-rest``, started here as a child process so that it has its own
interpreter and does not share the GIL with the client being measured). The three clients run in turn,
round after round, so that they share the machine's noise; the figure reported for each is its median
over the rounds.

    python benchmarks/publish_throughput.py [--messages 100000] [--rounds 3] [--threads 8]

Beside them, raw gRPC: pre-built ``PublishRequest`` bytes of 100 messages (``raw``) and of 1,000
(``raw-1000``), sent by 4 concurrent callers on one ``grpc.aio`` channel (``server_ingest.py``'s
publishers), against hedgepub with its default 100 messages per batch (``off``) and with
``BatchSettings(max_messages=1000)`` (``off-1000``): what a publisher could reach if building batches and
resolving futures cost nothing. ``--no-raw`` leaves them out.

Targets: hedgepub >= 4x the official client; hedging on (not triggered) >= 0.97x hedging off; hedgepub
>= 0.85x raw gRPC at 100 messages per request and >= 0.7x at 1,000.

With ``--threads N`` (N > 1), hedgepub also runs with N threads sharing one ``PublisherClient``, each
publishing its share of the N messages (the same total), hedging off and on, in the same rounds. Target:
N threads >= 0.95x one thread's rate, hedging off and on alike.

Every figure is printed as the median with [min-max] over the rounds, beside the load average. The CPU
time per message (the whole client process, every thread, over the timed part) is printed beside each
rate: on a busy machine it moves far less than messages/s.

With ``--no-server``, hedgepub publishes through an in-process transport that takes each request's bytes
and answers at once (no server, no network, no official client; see :class:`InstantTransport`), with
default batches and with ``--large-batch`` messages per batch: what is measured is the client's own cost,
the part threads contend for.

With ``--otel`` it measures OpenTelemetry's cost instead: hedgepub's sync client (hedging on, never
triggered) without OpenTelemetry importable, with it installed but off, on with the API's no-op providers,
and on with the SDK (spans batched to an exporter that drops them, metrics kept in memory); and, for
reference, the official client with its tracing on and the same SDK set-up. Each runs in a fresh child
process, so that all start equal. Target: installed but off >= 0.97x without.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

PROJECT = "bench-project"
PAYLOAD = b"x" * 100
HEDGE_DELAY = 1.0  # seconds; a healthy local server answers far sooner, so no hedge is sent
#: Messages each hedgepub client publishes before it is measured (the connection, the first calls).
WARM_UP = 2_000


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


def run_hedgepub(
    topic: str, messages: int, hedging: bool, threads: int = 1, server: bool = True, batch: int = 100
) -> tuple[float, int]:
    """Messages/s of hedgepub's sync client (``threads`` threads sharing it), and the hedges it sent.

    Without ``server``, requests go to an :class:`InstantTransport`. ``batch`` is the most
    messages per batch (the default's 100, or more).
    """
    from hedgepub import BatchSettings, HedgingSettings, PublisherClient

    settings = HedgingSettings(hedge_delay=HEDGE_DELAY) if hedging else None
    batching = BatchSettings(max_messages=batch)
    if server:
        publisher = PublisherClient(hedging_settings=settings, batch_settings=batching)
    else:
        publisher = PublisherClient(
            hedging_settings=settings, batch_settings=batching, transport=InstantTransport(topic)
        )

    def publish_share(count: int, published: list[int]) -> None:
        publish = publisher.publish
        futures = [publish(topic, PAYLOAD) for _ in range(count)]
        published.append(sum(1 for future in futures if future.result()))

    publish_share(WARM_UP, [])  # the channel's connection and first calls, outside the measurement

    def publish_all() -> int:
        if threads == 1:
            published: list[int] = []
            publish_share(messages, published)
            return published[0]
        shares = [messages // threads + (index < messages % threads) for index in range(threads)]
        published = []
        workers = [threading.Thread(target=publish_share, args=(share, published)) for share in shares]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return sum(published)

    try:
        rate = _measure(publish_all, messages)
    finally:
        publisher.shutdown()
    return rate, publisher.stats().hedges_sent


class InstantTransport:
    """``--no-server``'s transport: takes the request's bytes, as gRPC does, and answers at once with one ID
    per message, counting the messages from the request's length (every message here is ``PAYLOAD``).

    No parsing and no copy, so that what is measured is the publisher's own work. (The test double
    ``ScriptedTransport`` parses every request into a protobuf object first, a cost of its own.)
    """

    sends_bytes = True

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

    async def close(self) -> None:
        """Nothing to close."""


#: Raw gRPC's concurrent callers, as the issue's comparison used.
RAW_IN_FLIGHT = 4


def run_raw(address: str, topic: str, messages: int, batch: int) -> float:
    """Messages/s of raw gRPC: one ``PublishRequest`` of ``batch`` messages serialized up front, sent
    ``messages // batch`` times by :data:`RAW_IN_FLIGHT` concurrent callers (``server_ingest.py``'s);
    sets :data:`last_cpu_us_per_message` from the timed loop's process CPU."""
    import asyncio

    from server_ingest import build_request, publish_requests

    global last_cpu_us_per_message
    request = build_request(topic, batch, len(PAYLOAD))
    run = asyncio.run(publish_requests(address, max(1, messages // batch), RAW_IN_FLIGHT, request))
    if run.messages != max(1, messages // batch) * batch:
        raise RuntimeError(f"raw gRPC: {run.messages} messages acknowledged of {messages}")
    last_cpu_us_per_message = run.client_cpu_seconds / run.messages * 1e6
    return run.messages_per_second


def run_official(topic: str, messages: int) -> float:
    """Messages/s of google-cloud-pubsub's PublisherClient (found through PUBSUB_EMULATOR_HOST)."""
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient()

    def publish_all() -> int:
        publish = publisher.publish
        futures = [publish(topic, PAYLOAD) for _ in range(messages)]
        return sum(1 for future in futures if future.result())

    try:
        return _measure(publish_all, messages)
    finally:
        publisher.stop()


#: The --otel variants: (name, OpenTelemetry importable, enabled, SDK providers). "official-sdk" is
#: google-cloud-pubsub's client with its own tracing on, for reference.
class _Rounds:
    """Each variant's messages/s and CPU per message, round by round: the variant that goes first rotates
    (so none always runs on a cold or a warm machine), and each run prints its line as it ends."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._width = max(len(name) for name in names)
        self._rates: dict[str, list[float]] = {name: [] for name in names}
        self._cpu: dict[str, list[float]] = {name: [] for name in names}

    def order(self, round_number: int) -> list[str]:
        """The variants in the order they run in round ``round_number``."""
        shift = round_number % len(self.names)
        return self.names[shift:] + self.names[:shift]

    def record(self, round_number: int, name: str, rate: float, cpu_us: float) -> None:
        """Keep one run's figures and print them."""
        from server_ingest import load_average

        self._rates[name].append(rate)
        self._cpu[name].append(cpu_us)
        print(
            f"round {round_number + 1} {name:>{self._width}}: {rate:>10,.0f} messages/s  "
            f"{cpu_us:6.1f} us CPU/message  (load {load_average()})",
            flush=True,
        )

    def medians(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each variant's median messages/s, and its median CPU microseconds per message."""
        rates = {name: statistics.median(values) for name, values in self._rates.items()}
        cpu = {name: statistics.median(values) for name, values in self._cpu.items()}
        return rates, cpu

    def spreads(self, name: str) -> tuple[str, str]:
        """``median [min-max]`` of ``name``'s messages/s, and of its CPU microseconds per message."""
        from server_ingest import spread

        return spread(self._rates[name]), spread(self._cpu[name], ".1f")

    def ratio_spread(self, first: str, second: str) -> str:
        """The ratio of two variants' messages/s round by round (they ran in the same rounds), as
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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print messages/s and ratios; exit status 1 when a target is missed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per client per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs all three clients)")
    parser.add_argument(
        "--threads", type=int, default=1, help="also run hedgepub with this many threads sharing one client"
    )
    parser.add_argument(
        "--no-official", action="store_true", help="leave the official client out (thread runs only)"
    )
    parser.add_argument("--no-raw", action="store_true", help="leave raw gRPC (and the large batches) out")
    parser.add_argument(
        "--large-batch", type=int, default=1000, help="messages per request of the large raw/hedgepub runs"
    )
    parser.add_argument(
        "--no-server",
        action="store_true",
        help="hedgepub only, through a transport that answers at once: the client's own cost",
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
    options = parser.parse_args(argv)
    if options.otel:
        context = multiprocessing.get_context("spawn")
        with local_server() as address:
            variants = options.otel_variants.split(",") if options.otel_variants else None
            return otel_comparison(address, context, options.messages, options.rounds, variants)
    threaded = options.threads > 1
    large = options.large_batch
    raw = not (options.no_raw or options.no_server)
    names = ["off", "on"] + (["off-threads", "on-threads"] if threaded else [])
    names += [] if options.no_official or options.no_server else ["official"]
    names += ["raw", f"off-{large}", f"raw-{large}"] if raw else []
    names += [f"off-{large}"] if options.no_server else []

    from server_ingest import load_average

    load_before = load_average()
    runs = _Rounds(names)
    hedges = 0
    with contextlib.ExitStack() as stack:
        if options.no_server:
            address = ""
            topic_of = f"projects/{PROJECT}/topics/{{}}".format
        else:
            address = stack.enter_context(local_server())

            def topic_of(name: str) -> str:
                return create_topic(address, name)

        # Warm-up: imports, channels, server code paths.
        run_hedgepub(topic_of("warm-up-hedgepub"), 2_000, hedging=False, server=not options.no_server)
        if "official" in names:
            run_official(create_topic(address, "warm-up-official"), 2_000)
        if raw:
            run_raw(address, create_topic(address, "warm-up-raw"), 2_000, 100)
        for round_number in range(options.rounds):
            for name in runs.order(round_number):
                topic = topic_of(f"round-{round_number}-{name}")
                if name == "official":
                    rate = run_official(topic, options.messages)
                elif name.startswith("raw"):
                    rate = run_raw(address, topic, options.messages, large if name != "raw" else 100)
                else:
                    threads = options.threads if name.endswith("-threads") else 1
                    rate, sent = run_hedgepub(
                        topic,
                        options.messages,
                        hedging=name.startswith("on"),
                        threads=threads,
                        server=not options.no_server,
                        batch=large if name == f"off-{large}" else 100,
                    )
                    hedges += sent
                runs.record(round_number, name, rate, last_cpu_us_per_message)

    rates, cpus = runs.medians()
    print()
    print(
        f"{options.messages:,} messages of {len(PAYLOAD)} bytes, {options.rounds} rounds (medians "
        f"[min-max]); load average {load_before} before, {load_average()} after"
    )
    labels = {
        "off": "hedgepub sync, hedging off",
        "on": "hedgepub sync, hedging on",
        "off-threads": f"... {options.threads} threads, hedging off",
        "on-threads": f"... {options.threads} threads, hedging on",
        "official": "google-cloud-pubsub",
        "raw": f"raw gRPC, 100/request, {RAW_IN_FLIGHT} in flight",
        f"off-{large}": f"hedgepub, {large}/batch, hedging off",
        f"raw-{large}": f"raw gRPC, {large}/request, {RAW_IN_FLIGHT} in flight",
    }
    for name in names:
        rate_text, cpu_text = runs.spreads(name)
        print(f"{labels[name]:<38}: {rate_text:>28} messages/s  {cpu_text:>18} us CPU/message")
    print(f"hedges sent: {hedges}")

    checks: list[tuple[str, str, str, float]] = [("hedging on / off", "on", "off", 0.97)]
    if "official" in names:
        checks.insert(0, ("hedgepub / official", "off", "official", 4.0))
    if threaded:
        checks += [
            (f"{options.threads} threads / 1, off", "off-threads", "off", 0.95),
            (f"{options.threads} threads / 1, on", "on-threads", "on", 0.95),
            (f"{options.threads} threads on / off", "on-threads", "off-threads", 0.97),
        ]
    if raw:
        checks += [
            ("hedgepub / raw gRPC, 100", "off", "raw", 0.85),
            (f"hedgepub / raw gRPC, {large}", f"off-{large}", f"raw-{large}", 0.7),
        ]
    met = True
    for label, first, second, target in checks:
        value = rates[first] / rates[second]
        met &= value >= target
        print(
            f"{label:<38}: {runs.ratio_spread(first, second):>20}  (target >= {target:g}x)  "
            f"{'ok' if value >= target else 'MISSED'}  by CPU per message: {cpus[second] / cpus[first]:.2f}x"
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
