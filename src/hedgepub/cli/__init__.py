"""The ``hedgepub`` command line: ``serve``, ``proxy``, ``bench`` and a small Pub/Sub toolbox.

Each command lives in its own module and is registered here, so that starting one command does not
import the code of the others (``hedgepub serve`` should start in well under a second).

``-v``/``--verbose`` is accepted before the sub-command and after it (``hedgepub -vv serve`` and
``hedgepub serve -vv`` are the same); the counts add up. ``serve`` and ``bench`` need extras
(``hedgepub[server]``, ``hedgepub[bench]``): without them they say which one to install and exit with
code 6 (the codes: :mod:`hedgepub.cli._exit`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import click

from hedgepub._extras import MissingExtraError, missing_modules
from hedgepub._version import __version__
from hedgepub.cli._exit import EXIT_MISSING_EXTRA, exit_codes_help

# command name -> "module:attribute" of the click command, imported only when the command runs.
_COMMANDS: dict[str, str] = {
    "serve": "hedgepub.cli._serve:serve",
    "proxy": "hedgepub.cli._proxy:proxy",
    "bench": "hedgepub.cli._bench:bench",
    "advise": "hedgepub.cli._advise:advise_command",
    "topics": "hedgepub.cli._admin:topics",
    "subscriptions": "hedgepub.cli._admin:subscriptions",
    "publish": "hedgepub.cli._admin:publish",
    "pull": "hedgepub.cli._admin:pull",
    "transforms": "hedgepub.cli._transforms:transforms",
}
# command name -> the extra it needs beyond the base install.
_EXTRAS: dict[str, str] = {"serve": "server", "bench": "bench", "advise": "bench", "transforms": "server"}

_VERBOSITY_KEY = "hedgepub.verbosity"
_VERBOSE_HELP = "More logging: -v for info, -vv for debug (also after the sub-command)."
#: gRPC's asyncio layer logs this at DEBUG for every call it starts: noise that hides hedgepub's lines.
_GRPC_NOISE_LOGGER = "grpc._cython.cygrpc"
_GRPC_NOISE_PREFIX = "[_cygrpc] Loaded running loop"


def _drop_grpc_loop_noise(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_GRPC_NOISE_PREFIX)


def _set_verbosity(ctx: click.Context, more: int) -> None:
    """Add ``more`` to the command line's ``-v`` count and set the logging level from the total."""
    root = ctx.find_root()
    total = root.meta.get(_VERBOSITY_KEY, 0) + more
    root.meta[_VERBOSITY_KEY] = total
    # Without handlers yet (the usual case), one on stderr; a host that set up logging keeps its own.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if total:
        logging.getLogger().setLevel(logging.INFO if total == 1 else logging.DEBUG)
    noise = logging.getLogger(_GRPC_NOISE_LOGGER)
    if _drop_grpc_loop_noise not in noise.filters:
        noise.addFilter(_drop_grpc_loop_noise)


def _sub_command_verbosity(ctx: click.Context, param: click.Parameter, value: int) -> None:
    if value:
        _set_verbosity(ctx, value)


def _accept_verbosity(command: click.Command) -> click.Command:
    """Give ``command`` (and, for a group, its sub-commands) a ``-v`` option of its own, once."""
    if not getattr(command, "_hedgepub_verbosity", False):
        command.params.append(
            click.Option(
                ["-v", "--verbose"],
                count=True,
                expose_value=False,
                callback=_sub_command_verbosity,
                help=_VERBOSE_HELP,
            )
        )
        command._hedgepub_verbosity = True  # type: ignore[attr-defined]  # our mark on click's object
    if isinstance(command, click.Group):
        for sub_command in command.commands.values():
            _accept_verbosity(sub_command)
    return command


def _missing_extra_command(name: str, extra: str, missing: tuple[str, ...]) -> click.Command:
    """Stands in for a command whose extra is not installed: says what to install, exits with 6."""
    error = MissingExtraError(extra, f"hedgepub {name}", missing)

    def refuse(**_: Any) -> None:
        click.echo(f"error: {error}", err=True)
        raise click.exceptions.Exit(EXIT_MISSING_EXTRA)

    return click.Command(
        name,
        callback=refuse,
        help=f"(Not installed: pip install 'hedgepub[{extra}]'.)",
        epilog=exit_codes_help((EXIT_MISSING_EXTRA, f"the '{extra}' extra is not installed")),
        short_help=f"(needs: pip install 'hedgepub[{extra}]')",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


class _LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        extra = _EXTRAS.get(cmd_name)
        # As the package's own check at import: QuickJS is checked by the UDFs that need it.
        missing = missing_modules(extra, lazy=False) if extra else ()
        if extra and missing:
            return _missing_extra_command(cmd_name, extra, missing)
        module_name, attribute = target.split(":")
        return _accept_verbosity(getattr(importlib.import_module(module_name), attribute))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MissingExtraError as error:  # a part of a command that needs an extra of its own
            click.echo(f"error: {error}", err=True)
            raise click.exceptions.Exit(EXIT_MISSING_EXTRA) from None


@click.group(cls=_LazyGroup)
@click.version_option(__version__, "--version", prog_name="hedgepub", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help=_VERBOSE_HELP)
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """hedgepub: hedged publishing to Google Cloud Pub/Sub, and a local server to try it on.

    Exit codes (each command's --help lists its own): 0 done; 1 failed; 2 bad usage; 3 no server at the
    endpoint; 4 not found; 5 already exists; 6 a needed extra is not installed; 130 bench interrupted.
    """
    _set_verbosity(ctx, verbose)
