"""The optional parts of hedgepub and the extras that install them.

The base install (``pip install hedgepub``) is what publishing needs. The local server and the bench live
in extras; their packages check at import that the extra is there, so that a missing one is reported as
*which extra to install* rather than as a missing third-party module deep inside an import chain:

============  ==========================================  ==============================================
extra         what needs it                               modules it brings
============  ==========================================  ==============================================
``server``    ``hedgepub serve``, ``hedgepub.server``,    lark, fastavro, grpc_tools, aiohttp, cryptography,
              ``hedgepub transforms``                     quickjs, zstandard
``bench``     ``hedgepub bench``, ``hedgepub advise``     the ``server`` extra's, rich, matplotlib
``otel``      ``enable_open_telemetry=True``              opentelemetry (the API)
``all``       all of the above
============  ==========================================  ==============================================
"""

from __future__ import annotations

import importlib.util

#: The top-level modules each extra installs (what :func:`require` looks for).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "server": ("lark", "fastavro", "grpc_tools", "aiohttp", "cryptography", "quickjs", "zstandard"),
    "bench": (
        "lark",
        "fastavro",
        "grpc_tools",
        "aiohttp",
        "cryptography",
        "quickjs",
        "zstandard",
        "rich",
        "matplotlib",
    ),
    "otel": ("opentelemetry.trace", "opentelemetry.metrics"),
}
#: Modules of an extra that one feature imports when it runs, not the extra's package when it is imported
#: (:func:`require` leaves them out): the server runs without QuickJS and refuses a JavaScript UDF
#: transform, saying what to install (its wheels do not cover every Python version the package supports).
LAZY_MODULES: frozenset[str] = frozenset({"quickjs"})


class MissingExtraError(ModuleNotFoundError):
    """A part of hedgepub was used whose extra is not installed; the message says what to install.

    A :class:`ModuleNotFoundError` (so an ``ImportError``), with ``extra`` (its name) and ``missing`` (the
    modules not found).
    """

    def __init__(self, extra: str, feature: str, missing: tuple[str, ...]) -> None:
        super().__init__(
            f"{feature} needs the '{extra}' extra, which is not installed (missing: {', '.join(missing)}): "
            f"pip install 'hedgepub[{extra}]'",
            name=missing[0],
        )
        self.extra = extra
        self.missing = missing


def missing_modules(extra: str, *, lazy: bool = True) -> tuple[str, ...]:
    """The modules of ``extra`` that cannot be imported here (none: the extra is installed); without
    ``lazy``, leaving out :data:`LAZY_MODULES`."""
    missing = []
    for module in EXTRA_MODULES[extra]:
        if not lazy and module in LAZY_MODULES:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing, or an import hook refuses the module
            found = False
        if not found:
            missing.append(module)
    return tuple(missing)


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` if any of its modules is missing (but those of
    :data:`LAZY_MODULES`, which the feature needing one checks)."""
    missing = missing_modules(extra, lazy=False)
    if missing:
        raise MissingExtraError(extra, feature, missing)
