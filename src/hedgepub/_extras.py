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


def missing_modules(extra: str) -> tuple[str, ...]:
    """The modules of ``extra`` that cannot be imported here (none: the extra is installed)."""
    missing = []
    for module in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing, or an import hook refuses the module
            found = False
        if not found:
            missing.append(module)
    return tuple(missing)


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` if any of its modules is missing."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(extra, feature, missing)
