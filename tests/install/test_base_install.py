"""The base install (no extras) imports and publishes: checked in a fresh interpreter that refuses the
extras' modules, as an environment without them would (`.ci/run` also installs the built wheel in a fresh
virtual environment: tests/install/test_wheel.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hedgepub._extras import EXTRA_MODULES
from hedgepub.cli._exit import EXIT_MISSING_EXTRA

#: Top-level modules of the extras and of their dependencies (matplotlib's numpy and pillow included).
#: cryptography is not here: google-auth, a base dependency, requires it. opentelemetry is, although
#: google-cloud-pubsub installs its API: hedgepub must not need it unless asked for OpenTelemetry.
REFUSED = sorted(
    {module.split(".")[0] for modules in EXTRA_MODULES.values() for module in modules} - {"cryptography"}
    | {"numpy", "PIL", "fonttools", "kiwisolver", "pygments", "markdown_it", "aiohttp", "multidict", "yarl"}
)

# Installed first in each interpreter: a meta path finder that refuses the modules above, as if absent.
_REFUSE = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class _Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {REFUSED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, _Refuse())
    """
)

_PUBLISH = _REFUSE + textwrap.dedent(
    """
    import hedgepub

    with hedgepub.PublisherClient() as client:
        message_id = client.publish("projects/local-project/topics/base", b"from the base install").result(10)
    loaded = sorted({name.partition(".")[0] for name in sys.modules} & set(REFUSED))
    print(message_id, loaded)
    """
).replace("set(REFUSED)", repr(set(REFUSED)))


def _python(code: str, *args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **environment}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def _create_topic(address: str) -> None:
    from hedgepub.admin import AdminClient

    with AdminClient(address) as admin:
        admin.create_topic("projects/local-project/topics/base")


def test_the_refused_modules_are_installed_here_so_refusing_them_means_something() -> None:
    import importlib.util

    assert all(
        importlib.util.find_spec(name) is not None for name in ("lark", "matplotlib", "aiohttp", "rich")
    )


def test_hedgepub_imports_and_publishes_without_any_extra(pubsub_server) -> None:
    _create_topic(pubsub_server.address)
    completed = _python(_PUBLISH, PUBSUB_EMULATOR_HOST=pubsub_server.address)
    assert completed.returncode == 0, completed.stderr
    message_id, loaded = completed.stdout.split(" ", 1)
    assert loaded.strip() == "[]"  # nothing of the extras was imported
    [stored] = pubsub_server.messages("projects/local-project/topics/base")
    assert (stored.message_id, stored.data) == (message_id, b"from the base install")


def test_the_toolbox_publishes_without_any_extra(pubsub_server) -> None:
    _create_topic(pubsub_server.address)
    cli = _REFUSE + "from hedgepub.cli import main; main(prog_name='hedgepub')"
    completed = _python(cli, "publish", "base", "hello", PUBSUB_EMULATOR_HOST=pubsub_server.address)
    assert completed.returncode == 0, completed.stderr
    assert [m.data for m in pubsub_server.messages("projects/local-project/topics/base")] == [b"hello"]


@pytest.mark.parametrize(("command", "extra"), [("serve", "server"), ("bench", "bench"), ("advise", "bench")])
def test_a_command_without_its_extra_says_which_to_install(command: str, extra: str) -> None:
    cli = _REFUSE + "from hedgepub.cli import main; main(prog_name='hedgepub')"
    completed = _python(cli, command, "--port", "0")
    assert completed.returncode == EXIT_MISSING_EXTRA, completed.stderr
    assert f"pip install 'hedgepub[{extra}]'" in completed.stderr
    assert "Traceback" not in completed.stderr
    listed = _python(cli, "--help")
    assert listed.returncode == 0, listed.stderr
    assert f"hedgepub[{extra}]" in listed.stdout


@pytest.mark.parametrize(("module", "extra"), [("hedgepub.server", "server"), ("hedgepub.bench", "bench")])
def test_importing_a_part_without_its_extra_names_the_extra(module: str, extra: str) -> None:
    code = _REFUSE + textwrap.dedent(
        f"""
        try:
            import {module}
        except ImportError as error:
            print(type(error).__name__, error.extra, "|", error)
        """
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith(f"MissingExtraError {extra} |"), completed.stdout
    assert f"pip install 'hedgepub[{extra}]'" in completed.stdout


def test_the_server_and_serve_need_no_quickjs() -> None:
    # QuickJS has no wheel for some supported Python versions: only a JavaScript UDF needs it, and that
    # is refused saying what to install (tests/server/pubsub/test_transform_delivery.py).
    code = textwrap.dedent(
        """
        import sys
        sys.modules["quickjs"] = None  # as where it is not installed
        import hedgepub.server
        from hedgepub._extras import missing_modules
        from hedgepub.cli import main
        print(missing_modules("server"), missing_modules("server", lazy=False))
        sys.argv = ["hedgepub", "serve", "--help"]
        main()
        """
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("('quickjs',) ()\n"), completed.stdout
    assert "Usage: hedgepub serve" in completed.stdout


def test_the_rpc_table_is_in_the_base_install() -> None:
    code = _REFUSE + textwrap.dedent(
        """
        from hedgepub._rpcs import RPCS, STREAMING
        loaded = sorted({name.partition(".")[0] for name in sys.modules} & set(REFUSED))
        print(len(RPCS), sorted(STREAMING), "hedgepub.server" in sys.modules, loaded)
        """
    ).replace("set(REFUSED)", repr(set(REFUSED)))
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    count, rest = completed.stdout.split(" ", 1)
    assert int(count) > 30  # Publisher, Subscriber, SchemaService and IAMPolicy methods
    assert rest.strip() == "['StreamingPull'] False []"


def test_the_proxy_needs_no_extra() -> None:
    code = _REFUSE + textwrap.dedent(
        """
        from hedgepub.proxy import Proxy
        with Proxy("127.0.0.1:1") as proxy:
            address = proxy.address
        loaded = sorted({name.partition(".")[0] for name in sys.modules} & set(REFUSED))
        print(address.startswith("127.0.0.1:"), "hedgepub.server" in sys.modules, loaded)
        """
    ).replace("set(REFUSED)", repr(set(REFUSED)))
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "True False []"
