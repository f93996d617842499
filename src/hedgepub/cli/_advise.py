"""``hedgepub advise``: hedging settings for any client, predicted from measured publish latencies.

Exit codes: 0 done; 1 the input cannot be read or is refused (missing, malformed, no latencies, beyond
the limits of hedgepub.bench._latencies); 2 bad usage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from hedgepub.bench._advise import (
    DEFAULT_DELAYS,
    DEFAULT_PERCENTILES,
    DEFAULT_REFILLS,
    DEFAULT_TOKENS,
    MODELS,
    Advice,
    Prediction,
    advise,
    frontier,
    grid,
    write_advice_json,
)
from hedgepub.bench._latencies import INPUT_KINDS, MAX_PUBLISHES, load_latencies
from hedgepub.bench._snippets import CLIENT_SETTINGS, snippets
from hedgepub.cli._exit import EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_codes_help


def _numbers(kind: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str], tuple[Any, ...]]:
    """An option callback for a comma-separated list of numbers (``""`` for none)."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> tuple[Any, ...]:
        try:
            numbers = tuple(kind(part) for part in value.split(",") if part.strip())
            if not all(math.isfinite(number) for number in numbers):
                raise ValueError("not finite")
            return numbers
        except (ValueError, OverflowError):
            raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None

    return parse


class _FiniteRange(click.FloatRange):
    """A float range that refuses NaN (which every comparison lets through) and infinities."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _joined(values: tuple[Any, ...]) -> str:
    return ",".join(f"{value:g}" for value in values)


def _ms(value: float) -> str:
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _table(advice: Advice, shown: list[Prediction]) -> Table:
    table = Table(
        title=f"Predicted by replaying {len(advice.samples.latencies_s):,} measured publishes "
        f"({advice.model} model)",
        title_justify="left",
    )
    for column in ("setting", "delay", "tokens", "refill", "p50 ms", "p99 ms", "p99.9 ms", "extra RPCs"):
        table.add_column(column, justify="left" if column in ("setting", "delay") else "right")
    for prediction in shown:
        mark = " *" if prediction.name == advice.recommended.name else ""
        table.add_row(
            prediction.name + mark,
            prediction.delay,
            "-" if prediction.max_tokens is None else str(prediction.max_tokens),
            "-" if prediction.refill_ratio is None else f"{prediction.refill_ratio:g}",
            _ms(prediction.p50_ms),
            _ms(prediction.p99_ms),
            _ms(prediction.p999_ms),
            f"{prediction.extra_rpcs * 100:.1f}%",
        )
    return table


@click.command(
    short_help="Recommend hedging settings from measured publish latencies.",
    epilog=exit_codes_help(
        (EXIT_OK, "done"), (EXIT_FAILED, "the input cannot be read or is refused"), (EXIT_USAGE, "bad usage")
    ),
)
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "kind",
    type=click.Choice(list(INPUT_KINDS)),
    default="auto",
    show_default=True,
    help="bench: a hedgepub bench results.json; csv: per-publish latencies (latency_ms, latency_s or "
    "latency_us, optionally sent_at_s); monitoring: a Cloud Monitoring timeSeries export of "
    "topic/send_request_latencies; otel: an OpenTelemetry metrics export of hedgepub.publish.latency.",
)
@click.option(
    "--publisher",
    default="unhedged",
    show_default=True,
    help="Which publisher of a bench results.json to read.",
)
@click.option(
    "--delays",
    default=_joined(DEFAULT_DELAYS),
    show_default=True,
    callback=_numbers(float),
    help="Fixed hedge delays to try, in seconds (0.1 to 10).",
)
@click.option(
    "--percentiles",
    default=_joined(DEFAULT_PERCENTILES),
    show_default=True,
    callback=_numbers(float),
    help="Adaptive delay percentiles to try (50 to 99.9); '' for none.",
)
@click.option(
    "--tokens",
    default=_joined(DEFAULT_TOKENS),
    show_default=True,
    callback=_numbers(int),
    help="Token bucket sizes to try (1 to 250).",
)
@click.option(
    "--refills",
    default=_joined(DEFAULT_REFILLS),
    show_default=True,
    callback=_numbers(float),
    help="Refill ratios to try (0.001 to 0.2).",
)
@click.option(
    "--max-extra-rpcs",
    type=_FiniteRange(0, 10),
    default=0.1,
    show_default=True,
    help="The most extra RPCs per publish the recommendation may cost (0.1: 10%).",
)
@click.option(
    "--model",
    type=click.Choice(list(MODELS)),
    default="auto",
    show_default=True,
    help="trace: replay at the recorded send times, hedges see the latency of the publish sent nearest "
    "(needs send times); independent: every attempt draws from the distribution; auto: trace when "
    "send times are known.",
)
@click.option(
    "--rate",
    type=_FiniteRange(min=0, max=100_000, min_open=True),
    default=None,
    help="Publishes per second of the replay's schedule when the input has no send times  [default: 40]",
)
@click.option(
    "--max-publishes",
    type=click.IntRange(1, 10_000_000),
    default=MAX_PUBLISHES,
    show_default=True,
    help="The most per-publish latencies read (a CSV's rows, a bench publisher's samples); more is refused.",
)
@click.option("--seed", type=int, default=1, show_default=True, help="Seeds the replay's draws.")
@click.option(
    "--passes",
    type=click.IntRange(1, 10),
    default=2,
    show_default=True,
    help="Play the schedule this many times in a row, from a full bucket, and report the last: 2 predicts "
    "the steady state; 1 replays exactly what a bench run did.",
)
@click.option("--all", "show_all", is_flag=True, help="Show every setting tried, not only the frontier.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("advise-results"),
    show_default=True,
    help="Directory for advice.json and frontier.png.",
)
def advise_command(
    source: Path,
    kind: str,
    publisher: str,
    delays: tuple[float, ...],
    percentiles: tuple[float, ...],
    tokens: tuple[int, ...],
    refills: tuple[float, ...],
    max_extra_rpcs: float,
    model: str,
    rate: float | None,
    max_publishes: int,
    seed: int,
    passes: int,
    show_all: bool,
    out_dir: Path,
) -> None:
    """Predict p50/p99/p99.9 and extra RPCs of hedging settings from latencies measured without hedging.

    SOURCE holds measured publish latencies (see --format). They are replayed through hedgepub's own
    hedging engine on virtual time for every combination of --delays (and the adaptive --percentiles),
    --tokens and --refills. Prints the settings on the frontier (no other is better on both p99 and
    extra RPCs), the recommended one (lowest p99 within --max-extra-rpcs) as code for hedgepub, Java, Go
    and Rust, and writes OUT/advice.json and OUT/frontier.png.
    """
    if not delays and not percentiles:
        raise click.UsageError("give at least one fixed delay (--delays) or adaptive percentile")
    if not tokens or not refills:
        raise click.UsageError("give at least one token count (--tokens) and refill ratio (--refills)")
    try:
        candidates = grid(delays, percentiles, tokens, refills)
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None
    try:
        samples = load_latencies(source, kind, publisher, max_publishes)  # type: ignore[arg-type]  # click.Choice checked
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise click.ClickException(f"cannot read latencies from {source}: {error}") from None
    console = Console()
    if not console.is_terminal:  # a pipe or a file: room for the whole table
        console = Console(width=max(console.width, 120))
    console.print(
        f"[bold]hedgepub advise[/]: {len(samples.latencies_s):,} latencies from {samples.source}; "
        f"replaying {len(candidates)} settings through the hedging engine"
    )
    try:
        advice = advise(
            samples,
            candidates,
            max_extra_rpcs=max_extra_rpcs,
            model=model,  # type: ignore[arg-type]  # click.Choice checked it
            rate=rate,
            seed=seed,
            passes=passes,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    best = frontier(advice.predictions)
    shown = advice.predictions if show_all else _with(best, advice)
    console.print(_table(advice, shown))
    recommended, fixed = advice.recommended, advice.recommended_fixed
    console.print(
        f"\n[bold]recommended[/] (lowest predicted p99 within {max_extra_rpcs * 100:g}% extra RPCs): "
        f"{recommended.name}: p99 {_ms(recommended.p99_ms)} ms, p99.9 {_ms(recommended.p999_ms)} ms, "
        f"{recommended.extra_rpcs * 100:.1f}% extra RPCs"
    )
    if fixed.name != recommended.name:
        console.print(
            f"for Java, Go and Rust (fixed delay only): {fixed.name}: p99 {_ms(fixed.p99_ms)} ms, "
            f"{fixed.extra_rpcs * 100:.1f}% extra RPCs"
        )
    by_name = {c.name: c.hedging for c in candidates}
    code = snippets(by_name[recommended.name], by_name[fixed.name])
    if "hedgepub" not in code:
        console.print("hedging is not predicted to help within that budget: no settings to give")
    elif "java" not in code:
        console.print("no fixed-delay setting is predicted to help within that budget (Java, Go, Rust)")
    for client, text in code.items():
        console.print(f"\n[bold]{CLIENT_SETTINGS[client].client}[/]")
        # plain text, never cut at the terminal's width: it is meant to be copied
        console.print(text, markup=False, highlight=False, soft_wrap=True, end="")
    json_path = write_advice_json(advice, out_dir / "advice.json")
    from hedgepub.bench._plot import plot_frontier

    measured = advice.to_dict()["input"]["measured_p99_ms"]
    plot_path = plot_frontier(
        advice.predictions,
        out_dir / "frontier.png",
        recommended=recommended.name,
        measured_p99_ms=measured,
        subtitle=f"{samples.source}; {advice.model} model; measured p99 {_ms(measured)} ms (red line)",
    )
    console.print(f"\nwrote {json_path} and {plot_path}")


def _with(shown: list[Prediction], advice: Advice) -> list[Prediction]:
    """``shown`` plus unhedged and the recommendations, in the grid's order."""
    names = {p.name for p in shown} | {"unhedged", advice.recommended.name, advice.recommended_fixed.name}
    return [p for p in advice.predictions if p.name in names]
