"""What ``hedgepub bench`` shows and writes: progress bars while the experiment runs, then the table,
``results.json`` and the scenario's plot (:func:`write_outputs`). The command is :mod:`hedgepub.cli._bench`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

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

from hedgepub import HedgepubError, RpcError, StatusCode
from hedgepub.bench import (
    BenchConfig,
    BenchInterrupted,
    BenchRun,
    plot_latency_cdf,
    print_report,
    write_results_json,
)
from hedgepub.cli._exit import EXIT_INTERRUPTED, EXIT_UNREACHABLE

#: The plot file of each scenario, so that one run does not overwrite another's.
PLOT_FILES = {
    "latency-mix": "tail-latency.png",
    "correlated-stalls": "correlated-stalls.png",
    "reference": "reference.png",
    "packet-loss": "packet-loss.png",
    "dead-connection": "dead-connection.png",
    "lost-syn": "lost-syn.png",
}


def fault_text(config: BenchConfig) -> str:
    """A network scenario's fault in words, e.g. ``2% packet loss both ways``."""
    if config.scenario == "packet-loss":
        return f"{config.loss * 100:g}% packet loss both ways"
    if config.scenario == "dead-connection":
        return f"each publisher's busiest connection black-holed for {config.blackhole:g} s"
    return f"{config.syn_loss * 100:g}% of SYNs lost, no warm-up"


def network_text(config: BenchConfig, harness: str, why: str | None) -> str:
    """What a network scenario injects, and with which harness (and why not the kernel's)."""
    if harness == "kernel":
        where = "by the kernel's packet filter (iptables, a network namespace of its own)"
    else:
        where = f"by the userspace relay (FaultRelay; the kernel harness: {why})"
    return (
        f"{fault_text(config)} {where}; publishers unhedged, same_connection (hedges on the original's "
        "connection) and other_connection (channel_pool_size 2)"
    )


class ProgressBar:
    """Shows the experiment's phases as rich progress bars, one line per phase.

    Where the console is not a terminal (a log, a pipe) the bars are drawn once, at the end; each phase
    is then also announced by a plain line when it starts, so that a log shows how far a run got.
    """

    def __init__(self, console: Console) -> None:
        self._console = console
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

    def __enter__(self) -> ProgressBar:
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

    def interrupted(self) -> None:
        """The run was stopped early: leave the current bar where it stood, and say so."""
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, description=f"{task.description} [yellow](interrupted)[/]")
            self._progress.stop_task(self._task)
            self._task = None

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
        if not self._console.is_terminal:
            self._console.print(f"{description} ...", markup=False, highlight=False)
        self._task = self._progress.add_task(description, total=total)

    def advance(self, steps: int = 1) -> None:
        """Move the current bar on."""
        if self._task is not None:
            self._progress.advance(self._task, steps)


def delay_text(delays: tuple[float | str, ...]) -> str:
    return ", ".join(
        "adaptive (p95)"
        if delay == "auto"
        else f"adaptive (p{delay[5:]})"
        if isinstance(delay, str)
        else f"{float(delay) * 1000:g} ms"
        for delay in delays
    )


def run_with_progress(console: Console, start: Callable[[ProgressBar], Any]) -> BenchRun:
    """Run the experiment under progress bars; Ctrl-C before anything is measured exits with 130."""
    try:
        with ProgressBar(console) as progress:
            run: BenchRun = asyncio.run(start(progress))
            if run.interrupted:
                progress.interrupted()
    except BenchInterrupted as error:
        console.print(f"[yellow]{error}[/]")
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:  # Ctrl-C while the bench's servers or publishers were being set up
        console.print("[yellow]interrupted during the set-up: nothing was measured[/]")
        sys.exit(EXIT_INTERRUPTED)
    except RpcError as error:
        if error.code is StatusCode.UNAVAILABLE:
            console.print(f"[red]error[/]: cannot reach a Pub/Sub server: {error}")
            sys.exit(EXIT_UNREACHABLE)
        raise click.ClickException(f"the bench could not run: {error}") from error
    except HedgepubError as error:  # the warm-up publishes must succeed: nothing was measured yet
        raise click.ClickException(f"the bench could not run: {error}") from error
    return run


def write_outputs(console: Console, config: BenchConfig, run: BenchRun, out_dir: Path) -> None:
    """Print the table, write results.json and the scenario's plot; exit 130 after an interrupted run."""
    print_report(run.document, console)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_results_json(run.document, out_dir / "results.json")
    title, subtitle = plot_titles(run.document, config)
    plot_path = plot_latency_cdf(
        run.latencies_ms,
        out_dir / PLOT_FILES[config.scenario],
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
    if run.interrupted:
        measured = min(result.published + result.failed for result in run.results.values())
        console.print(
            f"[yellow]interrupted[/]: partial results, about {measured:,} of {config.messages:,} "
            f"publishes per publisher measured; wrote {json_path} and {plot_path}"
        )
        sys.exit(EXIT_INTERRUPTED)
    console.print(f"wrote {json_path} and {plot_path}")


def plot_titles(document: dict[str, Any], config: BenchConfig) -> tuple[str, str]:
    """The plot's title and subtitle for a run of ``config``."""
    target = document["config"].get("target")
    workload = f"{config.messages:,} publishes each at {config.rate:g}/s"
    if config.scenario == "reference":
        where = (
            f"the latency of {target['endpoint'] or 'the default endpoint'}"
            if target
            else f"{config.mix} on the bench's server"
        )
        title = "The Go and Rust hedging benchmarks' workload: unhedged vs hedged"
        subtitle = (
            f"{where}; {config.message_size:,}-byte messages; hedge delay "
            f"{delay_text(config.hedge_delays)}, {config.max_tokens} tokens, "
            f"refill {config.refill_ratio:g}; {workload} after {config.warmup_seconds:g} s of warm-up"
        )
    elif target is not None:
        title = f"Publish latency on {target['topic']}: unhedged vs hedged"
        subtitle = (
            f"endpoint {target['endpoint'] or 'default'}; hedge delays {delay_text(config.hedge_delays)}; "
            f"{workload}"
        )
    elif config.network_scenario:
        network = document["config"].get("network", {})
        title = f"Publish latency under {fault_text(config)}: hedges on the same connection vs another"
        subtitle = (
            f"{network.get('harness', '?')} harness; {config.message_size:,}-byte messages; hedge delay "
            f"{delay_text(config.hedge_delays)}; {workload}"
        )
    elif config.scenario == "correlated-stalls":
        title = "Publish latency under correlated stalls: hedges on the primary vs to a second endpoint"
        subtitle = (
            f"primary stalls {config.stall}; hedge delay {delay_text(config.hedge_delays)}; "
            f"{config.messages:,} publishes each at {config.rate:g}/s"
        )
    else:
        title = "Publish latency: unhedged vs hedged"
        subtitle = (
            f"injected on Publish: {config.mix}; hedge delays {delay_text(config.hedge_delays)}; "
            f"{config.messages:,} publishes each at {config.rate:g}/s"
        )
    return title, subtitle
