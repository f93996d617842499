"""How a long-running command (``hedgepub serve``, ``hedgepub proxy``) stops: the first SIGINT or SIGTERM
asks for a clean shutdown, a second one during it ends the process at once (exit code 128+N)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import click


def stop_on_signals() -> asyncio.Event:
    """An event the first SIGINT or SIGTERM sets (saying ``shutting down`` on stderr), on the running loop;
    a second signal while it is set ends the process with 128+N."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def request_stop(signum: signal.Signals) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        click.echo("shutting down", err=True)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no loop signal handlers on Windows
            loop.add_signal_handler(signum, request_stop, signum)
    return stop
