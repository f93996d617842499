"""The exit codes of the ``hedgepub`` command, one table for every sub-command.

====  ========================================================================================
0     done
1     failed: the server refused a request, a publish failed, the server or the bench could
      not start or run, Ctrl-C in a toolbox command
2     bad usage: unknown option, malformed value, no endpoint given
3     no Pub/Sub server answers at the endpoint
4     the topic or subscription does not exist (NOT_FOUND)
5     the topic or subscription already exists (ALREADY_EXISTS)
6     the command needs an extra that is not installed (``pip install 'hedgepub[server]'``, ...)
128+N ``hedgepub serve``: a second signal N during shutdown ended it at once (130: Ctrl-C)
130   ``hedgepub bench``: Ctrl-C stopped the run early (the partial results are written)
====  ========================================================================================

Each command's ``--help`` ends with the codes it can exit with, built by :func:`exit_codes_help`.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_FOUND = 4
EXIT_ALREADY_EXISTS = 5
EXIT_MISSING_EXTRA = 6
#: ``hedgepub bench`` stopped by Ctrl-C (the shell's code for SIGINT), its partial results written.
EXIT_INTERRUPTED = 130


def exit_codes_help(*meanings: tuple[int | str, str]) -> str:
    """A help epilog listing ``(code, meaning)`` pairs: ``Exit codes: 0 done; 1 ...``."""
    return "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in meanings) + "."
