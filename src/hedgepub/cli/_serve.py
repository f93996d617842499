"""``hedgepub serve``: run the local Pub/Sub-compatible server until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hedgepub._wire import EMULATOR_HOST_ENV
from hedgepub.cli._exit import EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_codes_help
from hedgepub.cli._signals import stop_on_signals

if TYPE_CHECKING:
    from hedgepub.server import AsyncLocalServer, IamConfig, ServerOptions
    from hedgepub.server._api.client_telemetry import HedgeTelemetryCounts
    from hedgepub.server._pubsub.hedge_dedup import HedgeDedupCounts

#: Where ``hedgepub serve`` keeps its SQLite database unless told otherwise (relative to the working
#: directory, so each project gets its own, and a .gitignore entry keeps it out of version control).
DEFAULT_DATA_DIR = ".hedgepub-data"

_FAULT_HELP = (
    "A fault rule, repeatable: METHOD:latency=P%:DURATION[,...], METHOD:error=CODE:P%[,...] and/or "
    "METHOD:stall=STALL/PERIOD[@PHASE] (every call arriving in a STALL-long window, one per PERIOD, waits "
    "until it ends; the phase comes from --seed unless given), joined by ';'. METHOD is a short name "
    "(Publish, StreamingPull, GetIamPolicy, ...), a full path or '*'. "
    "Example: 'Publish:latency=95%:5ms,4%:300ms,1%:4s;error=UNAVAILABLE:2%' or 'Publish:stall=500ms/5s'."
)


@click.command(
    epilog=exit_codes_help(
        (EXIT_OK, "stopped by Ctrl-C or SIGTERM"),
        (EXIT_FAILED, "could not start (address in use, data directory locked or damaged)"),
        (EXIT_USAGE, "bad usage or unreadable option file"),
        ("128+N", "a second signal N during shutdown ended it at once (130: Ctrl-C)"),
    )
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8085, show_default=True, help="Port (0: any free one)."
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"SQLite data directory, created if missing.  [default: ./{DEFAULT_DATA_DIR}]",
)
@click.option("--in-memory", is_flag=True, help="Keep everything in memory (lost on exit).")
@click.option("--fault", "faults", multiple=True, metavar="SPEC", help=_FAULT_HELP)
@click.option(
    "--faults-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='Fault rules as JSON: {"Publish": {"latency": "95%:5ms,5%:300ms", "errors": {"UNAVAILABLE": 0.2}, '
    '"stall": "500ms/5s"}}.',
)
@click.option(
    "--seed", type=int, default=None, help="Seed of the fault draws and stall phases, for repeatable runs."
)
@click.option(
    "--iam",
    "iam_mode",
    type=click.Choice(["off", "enforce"]),
    default="off",
    show_default=True,
    help="IAM enforcement: callers send 'authorization: Bearer TOKEN' and need the real permissions.",
)
@click.option(
    "--iam-tokens",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='With --iam enforce: JSON object from token to principal, {"t-alice": "user:alice@example.com"}.',
)
@click.option(
    "--iam-policy",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='With --iam enforce: project-level policy for every project, {"bindings": [{"role": ..., '
    '"members": [...]}]}.',
)
@click.option(
    "--dedup-hedges",
    is_flag=True,
    help="Store the attempts of one hedged batch once (hedgepub's: same hedgepub-batch-id metadata; Java, "
    "Go, Rust: same publish_start_time in the x-goog-pubsub-client-telemetry header and same messages): a "
    "later attempt of a committed batch gets the first one's message IDs. Off by default; Google Cloud "
    "Pub/Sub does not do this.",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Serve TLS with this PEM certificate chain (with --tls-key); clients connect to https://HOST:PORT.",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The PEM private key of --tls-cert.",
)
@click.option(
    "--rest/--no-rest",
    default=True,
    show_default=True,
    help="Serve REST/JSON (HTTP/1.1: gcloud, curl) on the same port as gRPC, as Google's emulator does "
    "(with --tls-cert too: the protocols a client offers in its TLS handshake tell the two apart).",
)
@click.option(
    "--relay",
    type=click.Choice(["process", "loop"]),
    default="process",
    show_default=True,
    envvar="HEDGEPUB_RELAY",
    show_envvar=True,
    help="How the one port relays gRPC connections with REST on: by a relay process that moves the bytes in "
    "the kernel (Linux; elsewhere the event loop does), or on the server's event loop.",
)
@click.option(
    "--relay-cpu",
    default=None,
    metavar="N|any",
    envvar="HEDGEPUB_RELAY_CPU",
    show_envvar=True,
    help="The CPU the relay process keeps to, or 'any' to leave it to the scheduler.  [default: the last "
    "CPU the server may use, measured best: the server's busy thread then runs on another]",
)
@click.option(
    "--buckets-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A directory standing for Cloud Storage: a Cloud Storage subscription of bucket B writes its files "
    "in DIR/B. Without it, Cloud Storage subscriptions are refused.",
)
def serve(
    host: str,
    port: int,
    data_dir: Path | None,
    in_memory: bool,
    faults: tuple[str, ...],
    faults_file: Path | None,
    seed: int | None,
    iam_mode: str,
    iam_tokens: Path | None,
    iam_policy: Path | None,
    dedup_hedges: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    rest: bool,
    relay: str,
    relay_cpu: str | None,
    buckets_dir: Path | None,
) -> None:
    """Run the local Pub/Sub server (durable on SQLite) until Ctrl-C or SIGTERM.

    Prints the `export PUBSUB_EMULATOR_HOST=...` line that points the official clients (and hedgepub)
    at it. Requests are logged with `hedgepub -vv serve`.
    """
    started = time.perf_counter()
    if in_memory and data_dir is not None:
        raise click.UsageError("--data-dir and --in-memory exclude each other: choose one.")

    # Imported here: `hedgepub --help` should not pay for gRPC and the protobuf classes.
    from hedgepub.server import DataDirError, FaultInjector, ServerOptions
    from hedgepub.server._front.relay import raise_descriptor_limit

    try:
        injector = FaultInjector.parse(faults, faults_file=faults_file, seed=seed)
    except ValueError as error:
        option = "--fault" if faults else "--faults-file"
        raise click.BadParameter(str(error), param_hint=f"'{option}'") from None

    iam = _iam_config(iam_mode, iam_tokens, iam_policy)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError(
            "--tls-cert and --tls-key go together: give both (or neither, for plain text)."
        )

    if not in_memory:
        data_dir = data_dir if data_dir is not None else Path(DEFAULT_DATA_DIR)
        # created, locked and checked by the server itself, which reports a problem in one line
    storage = "in memory (lost on exit)" if in_memory else f"SQLite in {data_dir}"
    options = ServerOptions(
        host=host,
        port=port,
        data_dir=data_dir,
        in_memory=in_memory,
        faults=injector,
        iam=iam,
        dedup_hedges=dedup_hedges,
        tls_cert=tls_cert,
        tls_key=tls_key,
        rest=rest,
        relay=relay,
        relay_cpu=_relay_cpu(relay_cpu),
        buckets_dir=buckets_dir,
    )

    announced = False

    def announce(server: AsyncLocalServer) -> None:
        nonlocal announced
        announced = True
        protocols = "gRPC and REST" if server.rest else "gRPC"
        click.echo(
            f"hedgepub server listening on {server.address} ({protocols}), storage {storage}", err=True
        )
        for name, rule in injector.rules.items():
            click.echo(f"fault injection on {name}: {rule}", err=True)
        if iam is not None:
            click.echo(f"IAM enforcement on: {iam!r}", err=True)
        if dedup_hedges:
            click.echo("dedup-hedges on: a hedged batch is stored once (the real service does not)", err=True)
        elapsed = time.perf_counter() - started
        if server.tls:
            # PUBSUB_EMULATOR_HOST means plain text to every client, so it cannot point at a TLS port.
            click.echo(
                f"ready in {elapsed:.2f} s; Ctrl-C to stop. TLS with {tls_cert}; connect with:", err=True
            )
            click.echo(f"endpoint=https://{server.address}")
        else:
            click.echo(f"ready in {elapsed:.2f} s; Ctrl-C to stop. Point clients at it with:", err=True)
            click.echo(f"export {EMULATOR_HOST_ENV}={server.address}")
        sys.stdout.flush()

    dedup_counts: list[HedgeDedupCounts] = []
    telemetry_counts: list[HedgeTelemetryCounts] = []
    # A connection holds a descriptor here (and six in the relay process, which raises its own limit):
    # a soft limit of 1,024, common, would refuse connections long before the hard limit.
    raise_descriptor_limit()
    try:
        asyncio.run(_run(options, announce, report=dedup_counts.append, telemetry=telemetry_counts.append))
    except KeyboardInterrupt:
        # Where the loop cannot take over SIGINT (Windows), Ctrl-C arrives as KeyboardInterrupt.
        pass
    except DataDirError as error:  # in use by another server, cannot be written, damaged database
        raise click.ClickException(str(error)) from None
    except OSError as error:  # the server never started (address taken, ...)
        if announced:
            raise
        raise click.ClickException(f"cannot start the server on {host}:{port}: {error}") from None
    except ValueError as error:  # a --tls-cert or --tls-key file that holds no PEM
        if announced:
            raise
        raise click.BadParameter(str(error), param_hint="'--tls-cert' / '--tls-key'") from None
    counts = injector.counts
    if counts.calls:
        click.echo(
            f"fault injection: {counts.calls} call{'s' if counts.calls != 1 else ''} met a rule, "
            f"{counts.delayed} delayed, {counts.failed} failed"
            + (f", {counts.stalled} stalled" if counts.stalled else ""),
            err=True,
        )
    for telemetry in telemetry_counts:
        if telemetry.with_telemetry or telemetry.malformed:
            click.echo(
                f"client telemetry: {telemetry.with_telemetry} of {telemetry.publishes} publishes carried "
                f"x-goog-pubsub-client-telemetry, {telemetry.hedges} of them hedges"
                + (f"; {telemetry.malformed} malformed headers ignored" if telemetry.malformed else ""),
                err=True,
            )
    for dedup in dedup_counts:
        click.echo(
            f"dedup-hedges: {dedup.stored} batches stored, {dedup.answered_from_window} repeated attempts "
            "answered with their batch's first message IDs",
            err=True,
        )


async def _run(
    options: ServerOptions,
    announce: Callable[[AsyncLocalServer], None],
    *,
    report: Callable[[HedgeDedupCounts], object] | None = None,
    telemetry: Callable[[HedgeTelemetryCounts], object] | None = None,
) -> None:
    """Serve on this loop until SIGINT or SIGTERM; a second signal during shutdown ends the process."""
    from hedgepub.server import serve as run_server

    stop = stop_on_signals()
    servers: list[AsyncLocalServer] = []

    def started(server: AsyncLocalServer) -> None:
        servers.append(server)  # kept to read its dedup counts once it stops
        announce(server)

    await run_server(options, on_started=started, stop=stop, grace=1.0)
    for server in servers:
        if server.hedge_dedup is not None and report is not None:
            report(server.hedge_dedup.counts)
        if telemetry is not None:
            telemetry(server.hedge_telemetry.counts)


def _relay_cpu(setting: str | None) -> int | str | None:
    """``--relay-cpu`` as :class:`~hedgepub.server.ServerOptions` takes it: None, a CPU number or "any"."""
    if setting is None or not setting.strip():
        return None
    setting = setting.strip()
    if setting == "any":
        return setting
    if setting.isdigit():
        return int(setting)
    raise click.BadParameter(f"{setting!r} is neither a CPU number nor 'any'", param_hint="'--relay-cpu'")


def _iam_config(mode: str, tokens: Path | None, policy: Path | None) -> IamConfig | None:
    """The IAM configuration asked for on the command line, or None when enforcement is off."""
    if mode == "off":
        if tokens is not None or policy is not None:
            raise click.UsageError("--iam-tokens and --iam-policy need --iam enforce.")
        return None
    if tokens is None:
        raise click.UsageError("--iam enforce needs --iam-tokens FILE (who each bearer token is).")
    from hedgepub.server import IamConfig, IamConfigError

    try:
        return IamConfig.from_files(tokens, policy)
    except IamConfigError as error:
        raise click.BadParameter(str(error), param_hint="'--iam-tokens' / '--iam-policy'") from None
