"""``hedgepub bench``: the tail-latency experiment, unhedged against hedged, as a table, a plot and JSON."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hedgepub import HedgepubError
from hedgepub.bench import (
    DEFAULT_MIX,
    DEFAULT_STALL,
    SCENARIOS,
    BenchConfig,
    plot_latency_cdf,
    print_report,
    run_bench,
    write_results_json,
)

_DEFAULTS = BenchConfig()
#: The hedge delay of the correlated-stalls scenario unless --hedge-delay gives one.
_STALL_HEDGE_DELAY = 0.1
#: Its measured publishes per publisher unless --messages gives them: 45 s at the default rate.
_STALL_MESSAGES = 1_800


class _ProgressBar:
    """Shows the experiment's phases as rich progress bars, one line per phase."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> _ProgressBar:
        self._progress.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._finish_task()
        self._progress.__exit__(exc_type, exc, traceback)

    def _finish_task(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            # a phase may end early (the token bucket filled before the warm-up's upper bound)
            done = max(task.completed, 1) if task.total is None else task.completed
            self._progress.update(self._task, total=done, completed=done)
            self._task = None

    def phase(self, description: str, total: int | None) -> None:
        """Start a new bar for the next phase."""
        self._finish_task()
        self._task = self._progress.add_task(description, total=total)

    def advance(self, steps: int = 1) -> None:
        """Move the current bar on."""
        if self._task is not None:
            self._progress.advance(self._task, steps)


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


def _delay_text(delays: tuple[float | str, ...]) -> str:
    return ", ".join(
        "adaptive (p95)"
        if delay == "auto"
        else f"adaptive (p{delay[5:]})"
        if isinstance(delay, str)
        else f"{float(delay) * 1000:g} ms"
        for delay in delays
    )


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


@click.command(short_help="Compare publish tail latency without and with hedging.")
@click.option(
    "--messages",
    type=click.IntRange(min=1),
    default=_DEFAULTS.messages,
    show_default=True,
    help="Measured publishes per publisher.",
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
    "MIX unused.",
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
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for results.json and tail-latency.png.",
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
    out_dir: Path,
) -> None:
    """Measure publish latency without and with hedging, side by side, on a local server.

    Starts a local Pub/Sub server in this process (127.0.0.1, in memory), injects the latency MIX on
    Publish, and publishes one message per batch on an open-loop schedule through several publishers at
    once: one unhedged, and one hedged per --hedge-delay entry (default: 100 ms and adaptive). Prints the
    latency percentiles of all, writes OUT/results.json and plots their latency distributions to
    OUT/tail-latency.png. The defaults take about a minute.

    --scenario correlated-stalls runs two servers instead: the primary stalls every publish that arrives
    in a window (--stall, 500 ms every 5 s), and hedges to the second server escape the window.
    """
    context = click.get_current_context()
    if scenario == "correlated-stalls":
        # The scenario's own defaults: one fixed hedge delay, and nine stall periods (under a minute).
        if context.get_parameter_source("hedge_delays") is click.core.ParameterSource.DEFAULT:
            hedge_delays = (_STALL_HEDGE_DELAY,)
        if context.get_parameter_source("messages") is click.core.ParameterSource.DEFAULT:
            messages = _STALL_MESSAGES
    try:
        config = BenchConfig(
            messages=messages,
            rate=rate,
            mix=mix,
            hedge_delays=hedge_delays,  # type: ignore[arg-type]  # floats and "auto", as parsed
            max_tokens=max_tokens,
            refill_ratio=refill_ratio,
            seed=seed,
            warmup=warmup,
            arrivals=arrivals,  # type: ignore[arg-type]  # click.Choice checked it
            scenario=scenario,  # type: ignore[arg-type]  # click.Choice checked it
            stall=stall,
            idempotency_key=idempotency_key,
            dedup_hedges=dedup_hedges,
        )
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None
    console = Console()
    injected = (
        f"stalls on the primary's Publish {config.stall} (a second server takes cross-endpoint hedges)"
        if config.scenario == "correlated-stalls"
        else f"latency on Publish {config.mix}"
    )
    console.print(
        f"[bold]hedgepub bench[/]: {config.messages:,} publishes per publisher at {config.rate:g}/s each "
        f"(about {config.expected_seconds():.0f} s), {injected}, "
        f"hedge delays {_delay_text(config.hedge_delays)}, bucket {config.max_tokens} tokens "
        f"refilled {config.refill_ratio:g} per batch"
    )
    try:
        with _ProgressBar(console) as progress:
            run = asyncio.run(run_bench(config, progress))
    except HedgepubError as error:  # the warm-up publishes must succeed: nothing was measured yet
        raise click.ClickException(f"the bench could not run: {error}") from error
    print_report(run.document, console)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_results_json(run.document, out_dir / "results.json")
    if config.scenario == "correlated-stalls":
        title = "Publish latency under correlated stalls: hedges on the primary vs to a second endpoint"
        subtitle = (
            f"primary stalls {config.stall}; hedge delay {_delay_text(config.hedge_delays)}; "
            f"{config.messages:,} publishes each at {config.rate:g}/s"
        )
    else:
        title = "Publish latency: unhedged vs hedged"
        subtitle = (
            f"injected on Publish: {config.mix}; hedge delays {_delay_text(config.hedge_delays)}; "
            f"{config.messages:,} publishes each at {config.rate:g}/s"
        )
    plot_path = plot_latency_cdf(
        run.latencies_ms,
        out_dir / "tail-latency.png",
        results=run.document["results"],
        title=title,
        subtitle=subtitle,
    )
    if run.max_schedule_lag_ms > 50:
        console.print(
            f"[yellow]note[/]: publishes started up to {run.max_schedule_lag_ms:,.0f} ms late "
            "(the machine was busy); every publisher was equally affected"
        )
    for name, count in run.missing.items():
        if count:
            console.print(f"[red]warning[/]: {count} {name} publishes reported success but are not stored")
    console.print(f"wrote {json_path} and {plot_path}")
