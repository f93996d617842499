"""The tail-latency experiment: the same open-loop workload through an unhedged publisher and hedged ones.

One local server runs in-process with a latency mix injected on ``Publish``. Every publisher (unhedged,
then one per configured hedge delay: a fixed number of seconds, or ``"auto"`` for the adaptive delay)
publishes one message per batch at the same moments of one arrival schedule (their order shuffled at
each moment), so machine noise, garbage collection and the server's load hit all alike, and the
comparison is made within one run rather than across several. Each publisher has its own topic, so the
duplicates that hedging may cause are counted per publisher.

Before measuring, a warm-up with no injected latency connects every channel and fills the hedged
publishers' token buckets (they start empty, as the spec says). It publishes to the measured topics,
since each topic has a bucket of its own; its messages are left out of the counts of stored copies. The
counters are read before and after the measured period and only the difference is reported.

The ``reference`` scenario is the workload of the Go and Rust clients' hedging benchmarks: their latency
mix, 200 publishes per second at fixed intervals, 1 KiB messages, one message per batch, a 5 s warm-up on
the same workload (latency injected, nothing recorded) and then 30 s measured, hedging after 100 ms with
50 tokens refilled by 0.1 per batch.

The ``correlated-stalls`` scenario models slowness correlated in time at one place instead: a second
local server starts beside the first, the first (the primary) gets stall windows on ``Publish`` (every
publish arriving in a window waits until it ends: 500 ms every 5 s by default) and the second nothing,
and three publishers run: ``unhedged``, ``hedged`` (hedges to the primary, where they stall as well) and
``cross_endpoint`` (hedges to the second server, ``hedge_endpoints``). Every publisher stamps idempotency
keys unless told not to, so ``duplicates_after_dedup`` shows what :class:`~hedgepub.Deduplicator` leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import hedgepub
from hedgepub import AdaptiveDelay, BatchSettings, RetrySettings
from hedgepub.admin import AdminClient
from hedgepub.bench._config import MAX_WARMUP, BenchConfig
from hedgepub.bench._report import UNHEDGED, LatencyRecorder, PublisherResult, results_document
from hedgepub.bench._schedule import arrival_times, pair_orders

if TYPE_CHECKING:
    from hedgepub import AsyncPublisherClient
    from hedgepub.bench._network import NetworkPlan
    from hedgepub.server import LatencyMix

#: How many warm-up publishes each publisher has in flight at once.
WARMUP_CONCURRENCY = 32
_PROJECT = "hedgepub-bench"


class BenchProgress(Protocol):
    """Where the experiment reports how far it is (the CLI shows a progress bar)."""

    def phase(self, description: str, total: int | None) -> None:
        """A new phase starts with ``total`` steps (``None``: unknown)."""

    def advance(self, steps: int = 1) -> None:
        """``steps`` more steps of the current phase are done."""


class _NoProgress:
    def phase(self, description: str, total: int | None) -> None:
        pass

    def advance(self, steps: int = 1) -> None:
        pass


@dataclass
class BenchRun:
    """The outcome of :func:`run_bench`: the ``results.json`` document and the raw latencies."""

    document: dict[str, Any]
    latencies_ms: dict[str, list[float]]
    results: dict[str, PublisherResult]
    #: how late the schedule's publishes started, worst case, in ms (a busy machine shows here)
    max_schedule_lag_ms: float = 0.0
    #: publishes that reported success but whose payload is not stored (should be 0)
    missing: dict[str, int] = field(default_factory=dict)
    #: the run was interrupted (Ctrl-C) during the measured period: the results cover what was measured
    interrupted: bool = False


class BenchInterrupted(Exception):
    """The bench was interrupted before anything was measured (during its set-up or warm-up)."""


@dataclass
class _Counters:
    attempts_sent: int
    hedges_sent: int
    hedges_won: int
    #: hedges sent per endpoint, by the bench's name for it (``primary``, ``second``)
    hedges_by_endpoint: dict[str, int]
    #: tokens in the hedging bucket(s) when read
    tokens: float = 0.0
    #: the hedge delay when read, ms (the adaptive one moves)
    delay_ms: float = 0.0

    @classmethod
    def of(cls, client: AsyncPublisherClient, endpoint_names: Mapping[str, str]) -> _Counters:
        stats = client.stats()
        by_endpoint = {
            endpoint_names.get(address, address): endpoint.hedges_sent
            for address, endpoint in stats.endpoints.items()
        }
        return cls(
            stats.attempts_sent,
            stats.hedges_sent,
            stats.hedges_won,
            by_endpoint,
            stats.tokens_available,
            stats.hedge_delay_ms,
        )

    def __sub__(self, other: _Counters) -> _Counters:
        return _Counters(
            self.attempts_sent - other.attempts_sent,
            self.hedges_sent - other.hedges_sent,
            self.hedges_won - other.hedges_won,
            {
                name: sent - other.hedges_by_endpoint.get(name, 0)
                for name, sent in self.hedges_by_endpoint.items()
            },
            self.tokens,
            self.delay_ms,
        )


#: The start of every warm-up payload, so that the counts of stored copies leave them out.
_WARMUP_PREFIX = b"warmup-"


def _payload(name: str, index: int, size: int = 0) -> bytes:
    base = f"{name}-{index:09d}".encode()
    # unique prefix (the dedup count reads it), padded to the configured size
    return base + b"x" * (size - len(base)) if size > len(base) else base


async def _warm_up(
    clients: Mapping[str, AsyncPublisherClient],
    topics: Mapping[str, str],
    config: BenchConfig,
    progress: BenchProgress,
) -> int:
    """Publish with no injected latency until every hedged bucket is full; returns publishes per client."""
    target = config.warmup_target()
    hedged = [client for name, client in clients.items() if name != UNHEDGED]
    progress.phase("warm-up", target)
    # Until full: on a busy machine some warm-up publishes take longer than the hedge delay, and their
    # hedges spend tokens, so the publishes that would just fill the bucket do not; up to MAX_WARMUP.
    limit = target if config.warmup is not None or target == 0 else MAX_WARMUP
    done = 0
    while done < limit:
        if config.warmup is None and all(
            client.stats().tokens_available >= config.max_tokens for client in hedged
        ):
            break
        size = min(WARMUP_CONCURRENCY, limit - done)
        publishes = [
            clients[name].publish(
                topics[name], _payload(f"warmup-{name}", done + offset, config.message_size)
            )
            for offset in range(size)
            for name in clients
        ]
        await asyncio.gather(*publishes)
        done += size
        progress.advance(size)
    return done


@dataclass
class _Measured:
    """What the open-loop schedule measured."""

    recorders: dict[str, LatencyRecorder]
    #: payloads published successfully, per publisher (to find missing and duplicated ones)
    published: dict[str, set[bytes]]
    failures: dict[str, int]
    #: worst lag of the schedule, ms
    lag_ms: float
    #: counters when the measured period began (after a ``warmup_seconds`` warm-up)
    before: dict[str, _Counters]
    interrupted: bool = False


async def _measure(
    clients: Mapping[str, AsyncPublisherClient],
    topics: Mapping[str, str],
    config: BenchConfig,
    progress: BenchProgress,
    counters: Callable[[], dict[str, _Counters]],
) -> _Measured:
    """Publish on the open-loop schedule: a ``warmup_seconds`` warm-up (not recorded), then measured.

    Ctrl-C (the task cancelled) ends the schedule early: the publishes in flight are cancelled and what
    was measured so far is returned, with ``interrupted`` set.
    """
    loop = asyncio.get_running_loop()
    names = tuple(clients)
    warm = config.warmup_schedule_publishes()
    total = warm + config.messages
    times = arrival_times(total, config.rate, seed=config.seed, arrivals=config.arrivals)
    orders = pair_orders(total, names, seed=config.seed)
    recorders = {name: LatencyRecorder() for name in names}
    published: dict[str, set[bytes]] = {name: set() for name in names}
    failures = dict.fromkeys(names, 0)
    measured_from = times[warm] if warm < total else 0.0
    if warm:
        progress.phase("warm-up on the workload", warm * len(names))

    async def publish_one(name: str, index: int, measured: bool) -> None:
        payload = _payload(name, index, config.message_size)
        started = loop.time()
        try:
            await clients[name].publish(topics[name], payload)
        except Exception:  # a failed publish is a result to count, not a reason to stop the run
            if measured:
                failures[name] += 1
        else:
            if measured:
                recorders[name].record(loop.time() - started, started - start - measured_from)
                published[name].add(payload)
        progress.advance()

    tasks: list[asyncio.Task[None]] = []
    worst_lag = 0.0
    before: dict[str, _Counters] = {}
    interrupted = False
    start = loop.time()
    try:
        for index, (offset, order) in enumerate(zip(times, orders, strict=True)):
            if index == warm:
                before = counters()  # the measured period's counters start here
                progress.phase("publishing", config.messages * len(names))
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            measured = index >= warm
            if measured:
                worst_lag = max(worst_lag, loop.time() - (start + offset))
            # open loop: start the publishes and move on, never waiting for earlier ones to answer
            tasks.extend(asyncio.create_task(publish_one(name, index, measured)) for name in order)
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        # Ctrl-C: keep what was measured; the publishes still in flight are not waited for
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not before:
            raise BenchInterrupted("interrupted during the warm-up: nothing was measured") from None
        interrupted = True
    return _Measured(recorders, published, failures, worst_lag * 1000.0, before, interrupted)


@dataclass(frozen=True)
class _Copy:
    """A stored message as :class:`~hedgepub.Deduplicator` reads it; IDs are per server, so prefixed."""

    message_id: str
    attributes: Mapping[str, str]


def _count_stored(servers: Mapping[str, Any], topic: str, expected: set[bytes]) -> tuple[int, int, int]:
    """(duplicates, duplicates after dedup, missing) of ``topic`` over every server.

    Duplicates are extra copies of a payload; after dedup, those a consumer running
    :class:`~hedgepub.Deduplicator` over every copy would still get; missing, ``expected`` payloads that
    no server stored.
    """
    from hedgepub import Deduplicator

    dedup = Deduplicator()
    stored = []
    passed = 0
    for name, server in servers.items():
        for message in server.messages(topic):
            if message.data.startswith(_WARMUP_PREFIX):
                continue  # the warm-up published to the same topic (to fill its bucket)
            stored.append(message.data)
            passed += not dedup.seen(_Copy(f"{name}/{message.message_id}", message.attributes))
    distinct = set(stored)
    return len(stored) - len(distinct), passed - len(distinct), len(expected - distinct)


def run_info(duration: float) -> dict[str, Any]:
    """When and where the run happened, for the ``config.run`` entry of ``results.json``."""
    return {
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": round(duration, 1),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "hedgepub": hedgepub.__version__,
    }


async def run_bench(config: BenchConfig, progress: BenchProgress | None = None) -> BenchRun:
    """Run the experiment described by ``config`` and return its results.

    Starts a local server (in memory, 127.0.0.1, ephemeral port) for the duration of the run, and a
    second one for the correlated-stalls scenario.

    Raises:
        BenchInterrupted: Ctrl-C came before the measured period began. During it, the run ends early
            and returns what it measured, with ``interrupted`` set.
    """
    # imported here, when a run starts, so that the report and plot helpers load without the server
    from hedgepub.server import LocalServer

    progress = progress or _NoProgress()
    if config.network_scenario:
        from hedgepub.bench._network import INSIDE_VARIABLE, NetworkPlan, resolve_harness, run_in_namespace

        harness, why = resolve_harness(config.network)
        if harness == "kernel" and not os.environ.get(INSIDE_VARIABLE):
            return await run_in_namespace(config, progress)
        plan = NetworkPlan(config, harness, why)
        with contextlib.ExitStack() as stack:
            return await _run(config, progress, servers=plan.open(stack), plan=plan)
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                LocalServer(host="127.0.0.1", port=0, in_memory=True, dedup_hedges=config.dedup_hedges)
            )
            for name in (("primary", "second") if config.scenario == "correlated-stalls" else ("primary",))
        }
        return await _run_on(servers, config, progress)


@dataclass(frozen=True)
class RemoteTarget:
    """Where a bench against a running service publishes: an endpoint and one existing topic.

    ``endpoint`` takes the publisher's forms; ``None`` means ``PUBSUB_EMULATOR_HOST``, else Google Cloud
    Pub/Sub with Application Default Credentials over TLS. Every publisher publishes to ``topic``, so all
    see the same service; duplicates are not counted (that would need a subscription).
    """

    endpoint: str | None
    topic: str


#: How long :func:`run_remote_bench` waits for a connection before saying that no server answers.
REACHABLE_TIMEOUT = 5.0


async def check_reachable(endpoint: str | None, timeout: float) -> None:
    """Raise ``RpcError(UNAVAILABLE)`` unless a connection to ``endpoint`` is made within ``timeout`` s.

    ``endpoint`` is resolved as the publishers resolve it (``None``: ``PUBSUB_EMULATOR_HOST``, else Google
    Cloud Pub/Sub); a TLS target is connected over TLS with the system's root certificates, as theirs
    are, but without credentials: what is checked is that something speaks gRPC there, not who may use it.
    """
    import grpc

    from hedgepub import RpcError, StatusCode
    from hedgepub._transport.grpc import CHANNEL_OPTIONS, resolve_endpoint

    target = resolve_endpoint(endpoint)
    if target.secure:
        channel = grpc.aio.secure_channel(
            target.target, grpc.ssl_channel_credentials(), options=CHANNEL_OPTIONS
        )
    else:
        channel = grpc.aio.insecure_channel(target.target, options=CHANNEL_OPTIONS)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except TimeoutError:
        raise RpcError(
            StatusCode.UNAVAILABLE,
            f"no Pub/Sub server answers at {endpoint or target.target} (no connection within {timeout:g} s)",
        ) from None
    finally:
        await channel.close(None)  # no grace: calls still running are cancelled


async def run_remote_bench(
    config: BenchConfig, target: RemoteTarget, progress: BenchProgress | None = None
) -> BenchRun:
    """Run the experiment against a running service (see :class:`RemoteTarget`); nothing is injected.

    The publishers connect as any application would (``endpoint``, credentials from the environment).
    Raises :class:`BenchInterrupted` as :func:`run_bench` does, and ``RpcError(UNAVAILABLE)`` before
    anything is published when no connection to the endpoint is made within :data:`REACHABLE_TIMEOUT`.
    """
    if config.scenario == "correlated-stalls":
        raise ValueError("the correlated-stalls scenario needs the bench's own two servers (no --topic)")
    return await _run(config, progress or _NoProgress(), remote=target)


async def _run_on(servers: Mapping[str, Any], config: BenchConfig, progress: BenchProgress) -> BenchRun:
    return await _run(config, progress, servers=servers)


async def _run(
    config: BenchConfig,
    progress: BenchProgress,
    *,
    servers: Mapping[str, Any] | None = None,
    remote: RemoteTarget | None = None,
    plan: NetworkPlan | None = None,
) -> BenchRun:
    from hedgepub import AsyncPublisherClient
    from hedgepub.server import FaultRule, LatencyMix, StallWindows

    stalls = config.scenario == "correlated-stalls"
    loop = asyncio.get_running_loop()
    began = loop.time()
    batch = BatchSettings(max_messages=1)
    retry = RetrySettings()
    specs = config.publishers()
    names = [spec.name for spec in specs]
    rule = None
    longest_delay = 0.0
    if servers is not None:
        mix = LatencyMix.parse(config.mix)
        rule = FaultRule(stall=StallWindows.parse(config.stall)) if stalls else FaultRule(latency=mix)
        longest_delay = rule.stall.stall if rule.stall is not None else _longest_delay(mix)
        if plan is not None:  # nothing injected in the server: the fault is on the network
            rule = None
        server = servers["primary"]
        endpoint: str | None = server.address
        endpoint_names = {running.address: name for name, running in servers.items()}
        if plan is not None:
            endpoint_names = plan.endpoint_names()
        topics = {name: f"projects/{_PROJECT}/topics/bench-{name}" for name in names}
        for running in servers.values():
            with AdminClient(running.address) as admin:
                admin.wait_ready(10.0)
                for topic in topics.values():
                    await loop.run_in_executor(None, admin.create_topic, topic)
    else:
        assert remote is not None
        endpoint = remote.endpoint
        # before any publisher: their retries would last the 600 s total timeout against a closed port
        await check_reachable(endpoint, REACHABLE_TIMEOUT)
        endpoint_names = {}
        topics = dict.fromkeys(names, remote.topic)
    if plan is not None:
        plan.before_clients()
    clients = {
        spec.name: AsyncPublisherClient(
            hedging_settings=spec.hedging,
            batch_settings=batch,
            retry_settings=retry,
            endpoint=plan.endpoint(spec) if plan is not None else endpoint,
            channel_pool_size=spec.pool_size,
            hedge_endpoints=[servers["second"].address] if spec.cross_endpoint and servers else None,
            idempotency_attribute=config.idempotency_key,
        )
        for spec in specs
    }

    def counters_now() -> dict[str, _Counters]:
        return {name: _Counters.of(client, endpoint_names) for name, client in clients.items()}

    try:
        try:
            # on the measured topics: each topic has a token bucket of its own, and the warm-up fills it
            warmup_done = await _warm_up(clients, topics, config, progress)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise BenchInterrupted("interrupted during the warm-up: nothing was measured") from None
        if plan is not None:
            plan.measuring()
        if servers is not None and rule is not None:
            servers["primary"].faults.seed(config.seed)  # stall windows count from here, phase from seed
            servers["primary"].faults.set("Publish", rule)
        measured = await _measure(clients, topics, config, progress, counters_now)
        after = counters_now()
        network_entry = plan.describe() if plan is not None else None  # before the connections close
        counters = {name: after[name] - measured.before[name] for name in names}
        delays_ms = {name: client.stats().hedge_delay_ms for name, client in clients.items()}
        measure_end = loop.time()
    finally:
        for client in clients.values():
            await client.shutdown(timeout=30.0)
    results: dict[str, PublisherResult] = {}
    missing: dict[str, int] = {}
    if servers is not None:
        # a losing attempt the server keeps working on after its caller gave up could still be stored
        if not measured.interrupted and plan is None:
            progress.phase("draining", None)
            await _drain(measure_end, longest_delay)
        if rule is not None:
            servers["primary"].faults.set("Publish", None)
    for name in names:
        duplicates: int | None = None
        after_dedup: int | None = None
        if servers is not None and plan is None:  # a plan's servers are processes of their own
            duplicates, after_dedup, missing[name] = _count_stored(
                servers, topics[name], measured.published[name]
            )
        results[name] = PublisherResult.from_measurements(
            measured.recorders[name],
            failed=measured.failures[name],
            attempts_sent=counters[name].attempts_sent,
            hedges_sent=counters[name].hedges_sent,
            hedges_won=counters[name].hedges_won,
            duplicates=duplicates,
            hedge_delay_ms=delays_ms[name] if name != UNHEDGED else None,
            duplicates_after_dedup=after_dedup,
            # against a service there is one endpoint: nothing to break down
            hedges_by_endpoint=counters[name].hedges_by_endpoint if name != UNHEDGED and servers else {},
        )
    config_entry = _config_entry(config, warmup_done, retry)
    config_entry["run"] = run_info(loop.time() - began)
    config_entry["run"]["max_schedule_lag_ms"] = round(measured.lag_ms, 1)
    config_entry["run"]["load_average"] = _load_average()
    # what each hedged publisher's bucket held when the measured period began (full after a warm-up)
    config_entry["run"]["tokens_at_start"] = {
        name: round(measured.before[name].tokens, 3) for name in names if name != UNHEDGED
    }
    # and its hedge delay then: an adaptive one is where the warm-up's latencies put it
    config_entry["run"]["hedge_delay_at_start_ms"] = {
        name: round(measured.before[name].delay_ms, 3) for name in names if name != UNHEDGED
    }
    if measured.interrupted:
        config_entry["run"]["interrupted"] = True
    if network_entry is not None:
        config_entry["network"] = network_entry
    if remote is not None:
        config_entry["target"] = {"endpoint": remote.endpoint, "topic": remote.topic}
    samples = {name: measured.recorders[name].samples() for name in names}
    return BenchRun(
        document=results_document(config_entry, results, samples),
        latencies_ms={name: measured.recorders[name].latencies_ms for name in names},
        results=results,
        max_schedule_lag_ms=measured.lag_ms,
        missing=missing,
        interrupted=measured.interrupted,
    )


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages when the run ended (timing figures depend on them)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


async def _drain(measure_end: float, longest_delay: float) -> None:
    """Wait until every attempt the server may still be delaying has reached its handler.

    Every attempt was sent before its publish resolved, so none is delayed past the end of the measured
    period plus the longest injected delay (the mix's, or a stall window). A losing attempt whose
    cancellation the server missed is stored by then, and counted as a duplicate.
    """
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, measure_end + longest_delay + 0.25 - loop.time()))


def _longest_delay(mix: LatencyMix) -> float:
    """The longest delay ``mix`` can inject, in seconds."""
    return max((bucket.delay for bucket in mix.buckets), default=0.0)


def _config_entry(config: BenchConfig, warmup_done: int, retry: RetrySettings) -> dict[str, Any]:
    entry = asdict(config)  # the option names: messages and rate are per publisher, hedge_delays in s
    entry["hedge_delays"] = list(config.hedge_delays)
    if "auto" in config.hedge_delays:
        entry["adaptive_delay"] = asdict(AdaptiveDelay())  # as the "adaptive" publisher uses it
    entry["warmup_publishes"] = warmup_done or config.warmup_schedule_publishes()
    entry["batch_max_messages"] = 1
    entry["retry"] = {
        "initial_rpc_timeout_s": retry.initial_rpc_timeout,
        "total_timeout_s": retry.total_timeout,
    }
    return entry
