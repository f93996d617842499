"""``hedgepub proxy``: forward every Pub/Sub RPC to an upstream and hedge Publish, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hedgepub._wire import EMULATOR_HOST_ENV
from hedgepub.cli._exit import EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_codes_help
from hedgepub.cli._signals import stop_on_signals

if TYPE_CHECKING:
    from hedgepub.proxy import AsyncProxy

#: Where the proxy listens unless told otherwise: loopback only, next to the server's usual 8085.
DEFAULT_LISTEN = "127.0.0.1:8086"


def _hedge_delay(ctx: click.Context, param: click.Parameter, value: str) -> float | str:
    text = value.strip().lower()
    if text == "auto":
        return text
    try:
        return float(text.removesuffix("s"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither seconds (0.1 to 10) nor 'auto'") from None


def _listen(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    host, colon, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (PORT 0 to 65535; 0: any free one)")
    return host, int(port)


@click.command(
    epilog=exit_codes_help(
        (EXIT_OK, "stopped by Ctrl-C or SIGTERM"),
        (EXIT_FAILED, "could not start (address in use, no credentials for Google)"),
        (EXIT_USAGE, "bad usage"),
        ("128+N", "a second signal N during shutdown ended it at once (130: Ctrl-C)"),
    ),
    short_help="Give any Pub/Sub client publish hedging: a local endpoint in front of Pub/Sub.",
)
@click.option(
    "--listen",
    default=DEFAULT_LISTEN,
    show_default=True,
    callback=_listen,
    metavar="HOST:PORT",
    help="Where clients connect (PUBSUB_EMULATOR_HOST). Loopback unless told otherwise: the proxy adds "
    "its own credentials to calls that carry none.",
)
@click.option(
    "--upstream",
    default="google",
    show_default=True,
    metavar="HOST:PORT|URL|google",
    help="Where calls go: 'google' (Google Cloud Pub/Sub over TLS, Application Default Credentials for "
    "callers without a token of their own), HOST:PORT (plain text unless the port is 443), http://... or "
    "https://....",
)
@click.option(
    "--hedge-delay",
    default="auto",
    show_default=True,
    callback=_hedge_delay,
    metavar="SECONDS|auto",
    help="Seconds before a Publish is hedged (0.1 to 10), or 'auto': the 95th percentile of recent "
    "latency (1 s until 100 publishes are seen).",
)
@click.option(
    "--max-tokens",
    type=int,
    default=50,
    show_default=True,
    help="Each topic's hedge token bucket (1 to 250).",
)
@click.option(
    "--refill-ratio",
    type=float,
    default=0.1,
    show_default=True,
    help="Tokens a successful publish puts back (0.001 to 0.2): at most one hedge per 1/ratio publishes.",
)
@click.option("--no-hedging", is_flag=True, help="Forward Publish with retries only, no hedges.")
@click.option(
    "--hedge-endpoint",
    "hedge_endpoints",
    multiple=True,
    metavar="ENDPOINT",
    help="Send hedges to this endpoint (repeatable; hedge k goes to the k-th), as the publisher's.",
)
@click.option(
    "--channel-pool-size",
    type=click.IntRange(1, 16),
    default=None,
    help="Connections per upstream endpoint that Publish attempts spread over.  [default: the publisher's]",
)
@click.option(
    "--max-in-flight-bytes",
    type=click.IntRange(1),
    default=None,
    help="Bytes of requests forwarded at once; beyond, calls get RESOURCE_EXHAUSTED.  [default: 64 MiB]",
)
@click.option(
    "--upstream-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Trust only this PEM certificate (chain) for a TLS upstream (a private CA, serve --tls-cert).",
)
def proxy(
    listen: tuple[str, int],
    upstream: str,
    hedge_delay: float | str,
    max_tokens: int,
    refill_ratio: float,
    no_hedging: bool,
    hedge_endpoints: tuple[str, ...],
    channel_pool_size: int | None,
    max_in_flight_bytes: int | None,
    upstream_ca: Path | None,
) -> None:
    """Run a local Pub/Sub endpoint that forwards every RPC to --upstream and hedges Publish.

    Point any client (Python, Node.js, Go, Java, .NET, ...) at it with the PUBSUB_EMULATOR_HOST line it
    prints: admin calls, pulls and StreamingPull go through unchanged; each Publish gets hedgepub's hedging
    (per-topic token buckets, the hedge delay, the telemetry header; a request with an ordering key is
    never hedged). Requests are logged with `hedgepub -vv proxy`.
    """
    from hedgepub import AdaptiveDelay, HedgingSettings
    from hedgepub.proxy import DEFAULT_MAX_IN_FLIGHT_BYTES, AsyncProxy

    host, port = listen
    hedging = None
    if not no_hedging:
        try:
            if isinstance(hedge_delay, str):  # "auto"
                adaptive = AdaptiveDelay()
                hedging = HedgingSettings(
                    max_tokens=max_tokens, refill_ratio=refill_ratio, adaptive_delay=adaptive
                )
            else:
                hedging = HedgingSettings(
                    hedge_delay=hedge_delay, max_tokens=max_tokens, refill_ratio=refill_ratio
                )
        except (TypeError, ValueError) as error:
            raise click.UsageError(str(error)) from None
    elif hedge_endpoints:
        raise click.UsageError("--hedge-endpoint needs hedging: drop --no-hedging.")
    try:
        running = AsyncProxy(
            upstream,
            host=host,
            port=port,
            hedging_settings=hedging,
            hedge_endpoints=hedge_endpoints,
            channel_pool_size=channel_pool_size,
            root_certificates=upstream_ca.read_bytes() if upstream_ca is not None else None,
            max_in_flight_bytes=max_in_flight_bytes or DEFAULT_MAX_IN_FLIGHT_BYTES,
        )
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--upstream'") from None

    def announce(started: AsyncProxy) -> None:
        hedges = "no hedging" if hedging is None else f"hedging {_describe(hedging)}"
        click.echo(
            f"hedgepub proxy listening on {started.address}, forwarding to {started.upstream.describe()}, "
            f"{hedges}; Ctrl-C to stop. Point clients at it with:",
            err=True,
        )
        click.echo(f"export {EMULATOR_HOST_ENV}={started.address}")
        sys.stdout.flush()

    try:
        asyncio.run(_run(running, announce))
    except KeyboardInterrupt:  # where the loop cannot take over SIGINT (Windows)
        pass
    except OSError as error:  # the port cannot be bound
        raise click.ClickException(str(error)) from None
    except Exception as error:  # no Application Default Credentials for Google, and the like
        if type(error).__module__.startswith("google.auth"):
            raise click.ClickException(f"no credentials for {upstream}: {error}") from None
        raise


def _describe(hedging: object) -> str:
    from hedgepub import HedgingSettings

    assert isinstance(hedging, HedgingSettings)
    delay = "auto (p95)" if hedging.adaptive_delay is not None else f"after {hedging.hedge_delay:g} s"
    return f"{delay}, {hedging.max_tokens} tokens per topic, refill {hedging.refill_ratio:g}"


async def _run(running: AsyncProxy, announce: Callable[[AsyncProxy], None]) -> None:
    """Serve on this loop until SIGINT or SIGTERM; a second signal during shutdown ends the process."""
    stop = stop_on_signals()
    await running.start()
    try:
        announce(running)
        await stop.wait()
        stats = running.stats()
    finally:
        await running.stop(grace=1.0)
    click.echo(
        f"proxy: {stats.batches_sent} publishes forwarded ({stats.messages_published} messages published, "
        f"{stats.messages_failed} failed), {stats.attempts_sent} attempts, {stats.hedges_sent} hedges sent, "
        f"{stats.hedges_won} won, {stats.hedges_skipped} not sent for want of a token",
        err=True,
    )
