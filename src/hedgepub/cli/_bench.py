"""``hedgepub bench``: the tail-latency experiment, unhedged against hedged, as a table, a plot and JSON.

Exit codes: 0 done; 1 the run failed or was declined at the prompt; 2 bad usage; 3 no server answers at
the endpoint; 130 interrupted (Ctrl-C): the partial results measured so far are written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from hedgepub import RpcError, StatusCode
from hedgepub.bench import (
    DEFAULT_MIX,
    DEFAULT_STALL,
    HARNESSES,
    NETWORK_SCENARIOS,
    SCENARIOS,
    BenchConfig,
    RemoteTarget,
    default_project,
    resource_path,
    run_bench,
    run_remote_bench,
)
from hedgepub.cli._bench_output import delay_text, network_text, run_with_progress, write_outputs
from hedgepub.cli._exit import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    exit_codes_help,
)

#: Pub/Sub bills each publish request as at least this many bytes.
_BILLED_MINIMUM_BYTES = 1000

_DEFAULTS = BenchConfig()
#: The hedge delay of the correlated-stalls scenario unless --hedge-delay gives one.
_STALL_HEDGE_DELAY = 0.1
#: Its measured publishes per publisher unless --messages gives them: 45 s at the default rate.
_STALL_MESSAGES = 1_800


def _parse_hedge_delays(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float | str, ...]:
    """``0.1,1,auto`` -> ``(0.1, 1.0, "auto")``; the ranges are checked by BenchConfig."""
    delays: list[float | str] = []
    for part in value.split(","):
        part = part.strip()
        if part == "auto" or part.startswith("auto:"):
            delays.append(part)
            continue
        try:
            delays.append(float(part))
        except ValueError:
            raise click.BadParameter(
                f"{part!r} is neither seconds (0.1 to 10) nor 'auto' (or 'auto:PERCENTILE'); "
                "give e.g. 0.1,1,auto"
            ) from None
    return tuple(delays)


def _checked_by(kind: str) -> Callable[[click.Context, click.Parameter, str], str]:
    """An option callback that parses its value with ``hedgepub.server.<kind>.parse`` and keeps the text."""

    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        import hedgepub.server

        try:
            getattr(hedgepub.server, kind).parse(value)
        except (TypeError, ValueError) as error:
            raise click.BadParameter(str(error)) from None
        return value

    return check


_check_stall = _checked_by("StallWindows")
_check_mix = _checked_by("LatencyMix")


def _checked_endpoint(_context: click.Context, _parameter: click.Parameter, value: str | None) -> str | None:
    """``--endpoint`` as given, once the publisher's parser takes it (a usage error, exit 2, if not)."""
    from hedgepub._transport.grpc import parse_endpoint

    if value is not None:
        try:
            parse_endpoint(value)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None
    return value


@click.command(
    short_help="Compare publish tail latency without and with hedging.",
    epilog=exit_codes_help(
        (EXIT_OK, "done"),
        (EXIT_FAILED, "the run failed or was declined at the prompt"),
        (EXIT_USAGE, "bad usage"),
        (EXIT_UNREACHABLE, "no server at the endpoint"),
        (EXIT_INTERRUPTED, "interrupted by Ctrl-C (the partial results are written)"),
    ),
)
@click.option(
    "--messages",
    type=click.IntRange(min=1),
    default=_DEFAULTS.messages,
    show_default=True,
    help="Measured publishes per publisher.",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Measure for this many seconds instead of a count (--messages is then DURATION x RATE).",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=_DEFAULTS.rate,
    show_default=True,
    help="Publishes per second per publisher (all publish at every arrival).",
)
@click.option(
    "--mix",
    default=DEFAULT_MIX,
    show_default=True,
    callback=_check_mix,
    help="Latency injected on Publish: P%:DURATION,... (the remainder gets no delay).",
)
@click.option(
    "--hedge-delay",
    "hedge_delays",
    default=",".join("auto" if d == "auto" else f"{d:g}" for d in _DEFAULTS.hedge_delays),
    show_default=True,
    callback=_parse_hedge_delays,
    help="One hedged publisher per comma-separated entry: seconds before a hedge (0.1 to 10), or "
    "'auto' for the adaptive delay (p95 of recent latency), 'auto:90' for another percentile.",
)
@click.option(
    "--max-tokens",
    type=int,
    default=_DEFAULTS.max_tokens,
    show_default=True,
    help="Token bucket size of each hedged publisher (1 to 250).",
)
@click.option(
    "--refill-ratio",
    type=float,
    default=_DEFAULTS.refill_ratio,
    show_default=True,
    help="Tokens added per successful batch (0.001 to 0.2).",
)
@click.option(
    "--seed", type=int, default=_DEFAULTS.seed, show_default=True, help="Seeds the schedule and latencies."
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=None,
    help="Warm-up publishes per publisher, with no injected latency  [default: until the bucket is full]",
)
@click.option(
    "--arrivals",
    type=click.Choice(["poisson", "fixed"]),
    default=_DEFAULTS.arrivals,
    show_default=True,
    help="Gaps between publishes: exponential (poisson) or equal (fixed).",
)
@click.option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    default=_DEFAULTS.scenario,
    show_default=True,
    help="latency-mix: the MIX on one server. correlated-stalls: two servers, the primary with stall "
    "windows (--stall), and three publishers: unhedged, hedged (on the primary) and cross_endpoint "
    "(hedges to the second server); one fixed --hedge-delay (default 0.1), --messages 1800 by default, "
    "MIX unused. reference: the Go and Rust clients' hedging benchmark (their MIX, 200/s fixed, 1 KiB, "
    "5 s warm-up on the workload, 30 s, --hedge-delay 0.1, 50 tokens, refill 0.1; options given win). "
    "packet-loss, dead-connection, lost-syn: a fault on real TCP between publisher and server (--network) "
    "and three publishers: unhedged, same_connection (hedges on the original's connection) and "
    "other_connection (channel_pool_size 2: hedges on the other one); 1 KiB at 100/s fixed for 30 s, "
    "--hedge-delay 0.1, MIX unused.",
)
@click.option(
    "--loss",
    type=click.FloatRange(0, 1, min_open=True),
    default=_DEFAULTS.loss,
    show_default=True,
    help="packet-loss: probability that a packet is lost, both ways, during the measured period.",
)
@click.option(
    "--blackhole",
    type=click.FloatRange(0, 600, min_open=True),
    default=_DEFAULTS.blackhole,
    show_default=True,
    metavar="SECONDS",
    help="dead-connection: how long each publisher's busiest connection delivers nothing (from a quarter "
    "into the measured period).",
)
@click.option(
    "--syn-loss",
    type=click.FloatRange(0, 1, min_open=True),
    default=_DEFAULTS.syn_loss,
    show_default=True,
    help="lost-syn: probability that a connection's SYN is lost (no warm-up: the first publishes connect).",
)
@click.option(
    "--network",
    type=click.Choice(list(HARNESSES)),
    default=_DEFAULTS.network,
    show_default=True,
    help="Where a network scenario's fault comes from: kernel (iptables in a network namespace of its "
    "own; Linux, root), relay (a userspace TCP relay, anywhere), auto (the kernel where it works).",
)
@click.option(
    "--stall",
    default=DEFAULT_STALL,
    show_default=True,
    callback=_check_stall,
    help="correlated-stalls: every publish arriving in a STALL-long window, one per PERIOD, waits until "
    "it ends (STALL/PERIOD; the phase comes from --seed).",
)
@click.option(
    "--idempotency-key/--no-idempotency-key",
    default=_DEFAULTS.idempotency_key,
    show_default=True,
    help="Publishers stamp idempotency keys, so duplicates_after_dedup shows what hedgepub.dedup leaves.",
)
@click.option(
    "--dedup-hedges",
    is_flag=True,
    help="The servers store each hedged batch once (as hedgepub serve --dedup-hedges; the real service "
    "does not).",
)
@click.option(
    "--message-size",
    type=click.IntRange(0, 10_000_000),
    default=0,
    help="Bytes of data per message  [default: a short payload of about 20 bytes]",
)
@click.option(
    "--warmup-seconds",
    type=click.FloatRange(0, 3600),
    default=0.0,
    help="Warm up on the measured workload itself for this long (latency injected, not recorded) "
    "instead of fast publishes until the bucket is full.",
)
@click.option(
    "--endpoint",
    metavar="ENDPOINT",
    default=None,
    callback=_checked_endpoint,
    help="Bench a running service instead of the bench's own server (needs --topic): HOST:PORT, "
    "http://HOST:PORT or https://HOST[:PORT]  [default: PUBSUB_EMULATOR_HOST, else Google Cloud "
    "Pub/Sub with Application Default Credentials over TLS]",
)
@click.option(
    "--topic",
    default=None,
    help="The topic to publish to on the running service (short ID or full path); giving it benches "
    "that service. Nothing is injected there: the latency is the service's own.",
)
@click.option(
    "--project",
    default=default_project,
    show_default="PUBSUB_PROJECT_ID, GOOGLE_CLOUD_PROJECT or local-project",
    help="Project of a short --topic ID.",
)
@click.option(
    "--create-topic",
    is_flag=True,
    help="Create --topic before the run and delete it afterwards.",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before publishing to a running service.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for results.json and the plot (tail-latency.png; correlated-stalls.png and "
    "reference.png for those scenarios).",
)
def bench(
    messages: int,
    rate: float,
    mix: str,
    hedge_delays: tuple[float | str, ...],
    max_tokens: int,
    refill_ratio: float,
    seed: int,
    warmup: int | None,
    arrivals: str,
    scenario: str,
    stall: str,
    idempotency_key: bool,
    dedup_hedges: bool,
    duration: float | None,
    message_size: int,
    warmup_seconds: float,
    endpoint: str | None,
    topic: str | None,
    project: str,
    create_topic: bool,
    yes: bool,
    out_dir: Path,
    loss: float,
    blackhole: float,
    syn_loss: float,
    network: str,
) -> None:
    """Measure publish latency without and with hedging, side by side, on a local server.

    Starts a local Pub/Sub server in this process (127.0.0.1, in memory), injects the latency MIX on
    Publish, and publishes one message per batch on an open-loop schedule through several publishers at
    once: one unhedged, and one hedged per --hedge-delay entry (default: 100 ms and adaptive). Prints the
    latency percentiles of all, writes OUT/results.json and plots their latency distributions to
    OUT/tail-latency.png. The defaults take about a minute.

    --scenario correlated-stalls runs two servers instead: the primary stalls every publish that arrives
    in a window (--stall, 500 ms every 5 s), and hedges to the second server escape the window.
    --scenario reference runs the Go and Rust clients' hedging benchmark workload.
    --scenario packet-loss, dead-connection and lost-syn put the fault on the network instead (the
    kernel's packet filter as root on Linux, else a userspace relay: the output says which).

    With --topic, the same experiment runs against a running service instead (--endpoint, else
    PUBSUB_EMULATOR_HOST, else Google Cloud Pub/Sub): every publisher publishes to that topic, nothing is
    injected, and the command first shows what it will publish and asks (unless --yes).

    Ctrl-C stops the run early: what was measured so far is reported and written (exit code 130).
    """
    context = click.get_current_context()

    def given(name: str) -> bool:
        return context.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT

    if scenario == "reference":
        reference = BenchConfig.reference()
        # The scenario's settings, except where an option was given.
        mix = mix if given("mix") else reference.mix
        rate = rate if given("rate") else reference.rate
        messages = messages if given("messages") else reference.messages
        arrivals = arrivals if given("arrivals") else reference.arrivals
        message_size = message_size if given("message_size") else reference.message_size
        warmup_seconds = warmup_seconds if given("warmup_seconds") else reference.warmup_seconds
        hedge_delays = hedge_delays if given("hedge_delays") else reference.hedge_delays
    if scenario == "correlated-stalls":
        # The scenario's own defaults: one fixed hedge delay, and nine stall periods (under a minute).
        if context.get_parameter_source("hedge_delays") is click.core.ParameterSource.DEFAULT:
            hedge_delays = (_STALL_HEDGE_DELAY,)
        if context.get_parameter_source("messages") is click.core.ParameterSource.DEFAULT:
            messages = _STALL_MESSAGES
    if scenario in NETWORK_SCENARIOS:
        network_defaults = BenchConfig.network_fault(scenario)
        rate = rate if given("rate") else network_defaults.rate
        messages = messages if given("messages") else network_defaults.messages
        arrivals = arrivals if given("arrivals") else network_defaults.arrivals
        message_size = message_size if given("message_size") else network_defaults.message_size
        hedge_delays = hedge_delays if given("hedge_delays") else network_defaults.hedge_delays
        warmup = warmup if given("warmup") else network_defaults.warmup
    if duration is not None:
        if given("messages"):
            raise click.UsageError("give --messages or --duration, not both")
        messages = max(1, round(duration * rate))
    harness, why = "", None
    if (endpoint is not None or create_topic) and topic is None:
        raise click.UsageError("--endpoint and --create-topic bench a running service: give its --topic")
    try:
        config = BenchConfig(
            messages=messages,
            rate=rate,
            mix=mix,
            hedge_delays=hedge_delays,
            max_tokens=max_tokens,
            refill_ratio=refill_ratio,
            seed=seed,
            warmup=warmup,
            arrivals=arrivals,  # type: ignore[arg-type]  # click.Choice checked it
            scenario=scenario,  # type: ignore[arg-type]  # click.Choice checked it
            stall=stall,
            idempotency_key=idempotency_key,
            dedup_hedges=dedup_hedges,
            message_size=message_size,
            warmup_seconds=warmup_seconds,
            loss=loss,
            blackhole=blackhole,
            syn_loss=syn_loss,
            network=network,  # type: ignore[arg-type]  # click.Choice checked it
        )
        remote: RemoteTarget | None = None
        if topic is not None:
            if config.scenario == "correlated-stalls" or config.network_scenario:
                raise ValueError(f"--scenario {config.scenario} needs the bench's own servers: drop --topic")
            remote = RemoteTarget(endpoint, resource_path(project, "topics", topic))
        if config.network_scenario:
            from hedgepub.bench._network import resolve_harness

            harness, why = resolve_harness(config.network)
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None
    console = Console()
    if remote is not None:
        _confirm_remote(console, config, remote, create_topic=create_topic, yes=yes)
        _run_remote(console, config, remote, create_topic=create_topic, out_dir=out_dir)
        return
    if config.network_scenario:
        injected = network_text(config, harness, why)
    elif config.scenario == "correlated-stalls":
        injected = (
            f"stalls on the primary's Publish {config.stall} (a second server takes cross-endpoint hedges)"
        )
    else:
        injected = f"latency on Publish {config.mix}"
    console.print(
        f"[bold]hedgepub bench[/]: {config.messages:,} publishes per publisher at {config.rate:g}/s each "
        f"(measured for about {config.expected_seconds():.0f} s, after the warm-up), {injected}, "
        f"hedge delays {delay_text(config.hedge_delays)}, bucket {config.max_tokens} tokens "
        f"refilled {config.refill_ratio:g} per batch"
    )
    run = run_with_progress(console, lambda progress: run_bench(config, progress))
    write_outputs(console, config, run, out_dir)


def _estimate(config: BenchConfig) -> tuple[int, int, int]:
    """(publishes, bytes of data, billed bytes at most) a run against a service sends, hedges included.

    Every publisher publishes every message of the warm-up and of the measured period; each hedged one
    may add up to its bucket's size plus ``refill_ratio`` per publish in hedges.
    """
    publishers = config.publishers()
    per_publisher = config.messages + config.warmup_target() + config.warmup_schedule_publishes()
    publishes = per_publisher * len(publishers)
    hedges = sum(
        min(per_publisher, spec.hedging.max_tokens + int(per_publisher * spec.hedging.refill_ratio))
        for spec in publishers
        if spec.hedging is not None
    )
    data = (publishes + hedges) * config.payload_bytes()
    billed = (publishes + hedges) * max(_BILLED_MINIMUM_BYTES, config.payload_bytes() + 100)
    return publishes, data, billed


def _confirm_remote(
    console: Console, config: BenchConfig, remote: RemoteTarget, *, create_topic: bool, yes: bool
) -> None:
    """Say what a run against a service will publish, and ask unless ``yes``."""
    publishes, data, billed = _estimate(config)
    endpoint = remote.endpoint or "PUBSUB_EMULATOR_HOST or Google Cloud Pub/Sub (pubsub.googleapis.com)"
    console.print(
        f"[bold]hedgepub bench[/] against {endpoint}, topic {remote.topic}"
        f"{' (created now, deleted afterwards)' if create_topic else ''}:\n"
        f"  {len(config.publishers())} publishers ({', '.join(s.name for s in config.publishers())}), "
        f"{config.messages:,} measured publishes each at {config.rate:g}/s (about "
        f"{config.expected_seconds():.0f} s) after a warm-up of "
        f"{config.warmup_target() + config.warmup_schedule_publishes():,};\n"
        f"  {publishes:,} messages of {config.payload_bytes():,} bytes ({data / 1e6:,.1f} MB with hedges); "
        f"estimated publish volume at most {billed / 1e6:,.1f} MB (each request billed as at least "
        f"{_BILLED_MINIMUM_BYTES:,} bytes), hedges included"
    )
    if not yes and not click.confirm("Publish these messages?", default=False):
        raise click.ClickException("declined: nothing was published")


def _admin_client(endpoint: str | None) -> Any:
    """An AdminClient for ``endpoint``; for Google Cloud Pub/Sub, with Application Default Credentials."""
    from hedgepub._transport.grpc import DEFAULT_ENDPOINT, resolve_endpoint
    from hedgepub.bench import AdminClient

    target = resolve_endpoint(endpoint)
    if target.target != DEFAULT_ENDPOINT:
        return AdminClient(endpoint)
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/pubsub"])
    credentials.refresh(google.auth.transport.requests.Request())
    return AdminClient(DEFAULT_ENDPOINT, access_token=credentials.token)


def _run_remote(
    console: Console, config: BenchConfig, remote: RemoteTarget, *, create_topic: bool, out_dir: Path
) -> None:
    """The bench against a running service: create the topic if asked, run, delete it again."""
    admin = None
    if create_topic:
        import google.auth.exceptions

        try:
            admin = _admin_client(remote.endpoint)
        except google.auth.exceptions.GoogleAuthError as error:
            raise click.ClickException(
                f"no Application Default Credentials for Google Cloud Pub/Sub: {error} (run "
                "`gcloud auth application-default login`, or give --endpoint)"
            ) from None
        try:
            admin.create_topic(remote.topic)
        except RpcError as error:
            admin.close()
            code = EXIT_UNREACHABLE if error.code is StatusCode.UNAVAILABLE else EXIT_FAILED
            console.print(f"[red]error[/]: cannot create {remote.topic}: {error}")
            sys.exit(code)
    try:
        run = run_with_progress(console, lambda progress: run_remote_bench(config, remote, progress))
    finally:
        if admin is not None:
            try:
                admin.delete_topic(remote.topic)
            except RpcError as error:
                console.print(f"[yellow]warning[/]: could not delete {remote.topic}: {error}")
            admin.close()
    write_outputs(console, config, run, out_dir)
