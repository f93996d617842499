"""Keep gRPC's C-core log lines off the terminal unless the user asks for them.

gRPC's core writes its own log lines straight to standard error (``E1130 12:00:00 add_port.cc:83] Failed to
add port ...``, ``I1130 ... chttp2_transport.cc ... Got goaway``). They duplicate errors hedgepub reports
in its own words, or describe normal events, and read as failures. The core reads ``GRPC_VERBOSITY`` once,
when ``grpc`` is first imported, so the choice has to be made before that import:

- a ``GRPC_VERBOSITY`` the user set is always left alone (``GRPC_VERBOSITY=debug hedgepub serve`` shows
  everything);
- if ``grpc`` was imported before hedgepub, its logging is already decided and is left alone too;
- the ``hedgepub`` command run with ``-vv`` (or more, before or after the sub-command) leaves gRPC's
  default, so its lines show: the package is imported before the command line is parsed, so
  :func:`command_line_verbosity` reads it;
- otherwise ``grpc`` is imported here with ``GRPC_VERBOSITY=NONE``, and the variable is removed again
  right after, so the user's environment (and every child process) stays as it was.

:func:`quiet_grpc_import` runs when this module is imported, which the ``hedgepub`` package does first of
all, before anything imports ``grpc``.
"""

from __future__ import annotations

import os
import sys

#: The variable gRPC's core reads at import: DEBUG, INFO, ERROR or NONE.
VERBOSITY_VARIABLE = "GRPC_VERBOSITY"


def quiet_grpc_import(verbosity: str = "NONE") -> bool:
    """Import ``grpc`` with its core logging at ``verbosity``, unless the user or an earlier import decided.

    Returns whether this call made the choice.
    """
    if "grpc" in sys.modules or VERBOSITY_VARIABLE in os.environ or command_line_verbosity() >= 2:
        return False
    os.environ[VERBOSITY_VARIABLE] = verbosity
    try:
        import grpc  # noqa: F401  # the import is the point: the core reads the variable now
    finally:
        os.environ.pop(VERBOSITY_VARIABLE, None)
    return True


def command_line_verbosity(argv: list[str] | None = None) -> int:
    """How many ``-v`` the ``hedgepub`` command was given, before or after its sub-command; 0 for others.

    The command is the ``hedgepub`` script, or ``python -m hedgepub`` (whose ``argv[0]`` is ``-m`` while
    the package is imported). Arguments after ``--`` are not options and are not counted.
    """
    argv = sys.argv if argv is None else argv
    if not argv or not (os.path.basename(argv[0]) in ("hedgepub", "hedgepub.exe") or argv[0] == "-m"):
        return 0
    count = 0
    for argument in argv[1:]:
        if argument == "--":
            break
        if argument == "--verbose":
            count += 1
        elif len(argument) > 1 and argument[0] == "-" and set(argument[1:]) == {"v"}:
            count += len(argument) - 1
    return count


quiet_grpc_import()
