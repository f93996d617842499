"""The ``hedgepub`` command line: ``serve``, ``bench`` and a small Pub/Sub toolbox.

Each command lives in its own module and is registered here, so that starting one command does not
import the code of the others (``hedgepub serve`` should start in well under a second).
"""

from __future__ import annotations

import importlib
import logging

import click

# command name -> "module:attribute" of the click command, imported only when the command runs.
_COMMANDS: dict[str, str] = {
    "serve": "hedgepub.cli._serve:serve",
    "bench": "hedgepub.cli._bench:bench",
    "advise": "hedgepub.cli._advise:advise_command",
    "topics": "hedgepub.cli._admin:topics",
    "subscriptions": "hedgepub.cli._admin:subscriptions",
    "publish": "hedgepub.cli._admin:publish",
    "pull": "hedgepub.cli._admin:pull",
}


class _LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=_LazyGroup)
@click.option("-v", "--verbose", count=True, help="More logging: -v for info, -vv for debug.")
def main(verbose: int) -> None:
    """hedgepub: hedged publishing to Google Cloud Pub/Sub, and a local server to try it on."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
