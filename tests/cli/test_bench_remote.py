"""``hedgepub bench`` against a running service (``--endpoint``/``--topic``), its prompt, and Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hedgepub import RpcError, StatusCode
from hedgepub.bench import AdminClient
from hedgepub.cli import main

from .._bench import starved_reason
from .._cli import CLI, served_address, terminate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _words(text: str) -> str:
    """``text`` with its line breaks (rich wraps at the terminal's width) and runs of spaces as one."""
    return " ".join(text.split())


@pytest.fixture
def faulty_server(tmp_path: Path) -> Iterator[str]:
    """``hedgepub serve`` in another process, one Publish in ten delayed by 1 s; yields its address."""
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [*CLI, "serve", "--port", "0", "--in-memory", "--seed", "5",
             "--fault", "Publish:latency=90%:1ms,10%:1s"],
            stdout=subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
        try:
            yield served_address(process, 30.0, log)
        finally:
            terminate(process)


def test_the_bench_against_hedgepub_serve_with_faults(faulty_server: str, tmp_path: Path) -> None:
    out = tmp_path / "remote"
    result = CliRunner().invoke(
        main,
        ["bench", "--endpoint", faulty_server, "--topic", "projects/p/topics/bench", "--create-topic",
         "--duration", "4", "--rate", "50", "--hedge-delay", "0.1", "--max-tokens", "20",
         "--refill-ratio", "0.2", "--warmup", "100", "--yes", "--out", str(out)],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "projects/p/topics/bench (created now, deleted afterwards)" in _words(result.output)
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["target"] == {"endpoint": faulty_server, "topic": "projects/p/topics/bench"}
    assert document["config"]["messages"] == 200  # 4 s at 50/s
    results = document["results"]
    assert list(results) == ["unhedged", "fixed-100ms"]
    unhedged, hedged = results["unhedged"], results["fixed-100ms"]
    for entry in (unhedged, hedged):
        assert (entry["published"], entry["failed"]) == (200, 0)
        assert entry["duplicates"] is None  # not counted against a service: that would need a subscription
    assert hedged["hedges_sent"] > 0 and hedged["attempts_per_publish"] > 1
    assert len(document["samples"]["unhedged"]["latency_ms"]) == 200
    assert (out / "tail-latency.png").read_bytes().startswith(PNG_SIGNATURE)
    with AdminClient(faulty_server) as admin, pytest.raises(RpcError) as deleted:
        admin.get_topic("projects/p/topics/bench")
    assert deleted.value.code is StatusCode.NOT_FOUND  # deleted again
    if unhedged["p50_ms"] > 50:
        pytest.skip(starved_reason(document, unhedged["p50_ms"], injected_ms=1))
    assert unhedged["p99_ms"] >= 1000 and hedged["p99_ms"] < 0.8 * unhedged["p99_ms"], result.output


def test_the_bench_asks_before_publishing_to_a_service(faulty_server: str, tmp_path: Path) -> None:
    arguments = ["bench", "--endpoint", faulty_server, "--topic", "asked", "--project", "p",
                 "--messages", "20", "--message-size", "1024", "--out", str(tmp_path / "out")]  # fmt: skip
    with AdminClient(faulty_server) as admin:
        admin.create_topic("projects/p/topics/asked")
        declined = CliRunner().invoke(main, arguments, input="n\n")
        assert declined.exit_code == 1, declined.output
        # what it would send: 3 publishers x (20 measured + 500 warm-up) messages of 1 KiB
        said = _words(declined.output)
        assert "1,560 messages of 1,024 bytes" in said
        assert "Publish these messages? [y/N]" in said and "declined" in said
        assert not (tmp_path / "out").exists()
        accepted = CliRunner().invoke(main, [*arguments, "--warmup", "10"], input="y\n")
        assert accepted.exit_code == 0, accepted.output
        assert json.loads((tmp_path / "out" / "results.json").read_text())["config"]["message_size"] == 1024


def test_remote_options_are_checked(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, message in [
        (("--endpoint", "127.0.0.1:1"), "give its --topic"),
        (("--topic", "t", "--scenario", "correlated-stalls"), "drop --topic"),
        (("--duration", "3", "--messages", "10"), "not both"),
    ]:
        result = runner.invoke(main, ["bench", *args, "--yes", "--out", str(tmp_path / "x")])
        assert result.exit_code == 2, (args, result.output)
        assert message in _words(result.output), (args, result.output)


def test_an_unreachable_endpoint_exits_3(tmp_path: Path, closed_port: int) -> None:
    result = CliRunner().invoke(
        main,
        ["bench", "--endpoint", f"127.0.0.1:{closed_port}", "--topic", "t", "--create-topic", "--yes",
         "--messages", "5", "--out", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 3, result.output


@pytest.mark.timeout(120)
def test_a_closed_port_exits_3_before_the_warm_up(tmp_path: Path, closed_port: int) -> None:
    # No --create-topic: nothing but the publishers would talk to the endpoint, and their retries last the
    # 600 s total timeout; the bench checks that a server answers there before it warms up.
    endpoint = f"127.0.0.1:{closed_port}"
    process = subprocess.run(
        [*CLI, "bench", "--endpoint", endpoint, "--topic", "bench", "--project", "p", "--yes",
         "--duration", "2", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=90, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    said = _words(process.stdout + process.stderr)
    assert process.returncode == 3, said
    assert f"no Pub/Sub server answers at {endpoint}" in said, said
    assert "Traceback" not in said and not (tmp_path / "out").exists()


def test_google_is_the_default_and_needs_application_default_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No endpoint and no PUBSUB_EMULATOR_HOST: Google Cloud Pub/Sub, with ADC; none here, so it says so
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    result = CliRunner().invoke(
        main, ["bench", "--topic", "t", "--project", "p", "--create-topic", "--messages", "5", "--out",
               str(tmp_path / "out")], input="y\n",
    )  # fmt: skip
    said = _words(result.output)
    assert "against PUBSUB_EMULATOR_HOST or Google Cloud Pub/Sub (pubsub.googleapis.com)" in said
    assert result.exit_code == 1, result.output
    assert "no Application Default Credentials" in said


def _emulator_binary() -> Path | None:
    configured = os.environ.get("PUBSUB_EMULATOR_BIN")
    if configured:
        return Path(configured) if Path(configured).exists() else None
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    sdk = Path(os.path.realpath(gcloud)).parent.parent
    candidate = sdk / "platform" / "pubsub-emulator" / "bin" / "cloud-pubsub-emulator"
    return candidate if candidate.exists() else None


def test_the_bench_against_googles_emulator(tmp_path: Path, closed_port: int) -> None:
    binary = _emulator_binary()
    if binary is None:
        pytest.skip("Google's Pub/Sub emulator is not installed (gcloud's pubsub-emulator component)")
    process = subprocess.Popen(
        [str(binary), "--host=127.0.0.1", f"--port={closed_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", closed_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail("Google's emulator did not start within 60 s")
                time.sleep(0.5)
        out = tmp_path / "emulator"
        result = CliRunner().invoke(
            main,
            ["bench", "--endpoint", f"127.0.0.1:{closed_port}", "--topic", "bench", "--project", "p",
             "--create-topic", "--duration", "2", "--rate", "40", "--warmup", "50", "--hedge-delay", "0.1",
             "--yes", "--out", str(out)],
            catch_exceptions=False,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        results = json.loads((out / "results.json").read_text())["results"]
        assert [(r["published"], r["failed"]) for r in results.values()] == [(80, 0)] * 2
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the launcher script and its JVM
        process.wait(30)


#: ``hedgepub`` run so that SIGUSR1 prints every thread's stack (what a test shows when the bench hangs).
DUMPABLE_CLI = [
    sys.executable,
    "-c",
    "import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "from hedgepub.cli import main; main()",
]


def _interrupt_after(process: subprocess.Popen[bytes], line: str, after: float, timeout: float) -> bytes:
    """Send SIGINT ``after`` seconds after ``process`` printed a line starting with ``line``; return all
    it printed.

    Fails the test, with every thread's stack, when ``line`` does not come within ``timeout`` s or the
    process has not ended ``timeout`` s after the signal.
    """
    chunks: list[bytes] = []
    seen = threading.Event()
    stdout = process.stdout
    assert stdout is not None

    def pump() -> None:
        for chunk in iter(stdout.readline, b""):
            chunks.append(chunk)
            if chunk.decode(errors="replace").startswith(line):
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not seen.wait(timeout):
            raise AssertionError(f"no {line!r} line within {timeout:g} s")
        time.sleep(after)
        process.send_signal(signal.SIGINT)
        process.wait(timeout)
    except (AssertionError, subprocess.TimeoutExpired) as error:
        process.send_signal(signal.SIGUSR1)  # the stacks go to stderr, which is stdout here
        time.sleep(1)  # for the dump to reach the pipe; the process is killed next
        process.kill()
        process.wait()
        reader.join(5)
        pytest.fail(f"{error}; the bench printed:\n{b''.join(chunks).decode(errors='replace')}")
    reader.join(10)
    return b"".join(chunks)


def _start_bench(out: Path, *, messages: int, warmup: int) -> subprocess.Popen[bytes]:
    """``hedgepub bench`` at 50 publishes/s of 1 ms each, writing to ``out``, its output on one pipe."""
    return subprocess.Popen(
        [*DUMPABLE_CLI, "bench", "--messages", str(messages), "--rate", "50", "--warmup", str(warmup),
         "--mix", "100%:1ms", "--hedge-delay", "0.1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip


def test_ctrl_c_writes_the_partial_results(tmp_path: Path) -> None:
    out = tmp_path / "partial"
    process = _start_bench(out, messages=100000, warmup=0)
    # the measured period has begun (a log says so, line by line); Ctrl-C comes a second into it, after
    # about 50 publishes per publisher
    output = _interrupt_after(process, "publishing ...", after=1.0, timeout=60)
    text = _words(output.decode())
    assert process.returncode == 130, text
    assert "interrupted" in text and "partial results" in text and "Aborted!" not in text
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["run"]["interrupted"] is True
    published = document["results"]["unhedged"]["published"]
    assert 0 < published < 100000
    assert (out / "tail-latency.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("hedgepub bench:", "nothing was measured"),  # while its server and publishers are set up
        ("warm-up ...", "nothing was measured"),  # before the measured period
        ("publishing ...", "partial results"),  # at its very start
    ],
)
def test_ctrl_c_at_any_phase_exits_130_saying_what_was_measured(tmp_path: Path, line: str, said: str) -> None:
    out = tmp_path / "early"
    process = _start_bench(out, messages=1000, warmup=1)
    text = _words(_interrupt_after(process, line, after=0.0, timeout=60).decode())
    assert process.returncode == 130, text
    assert said in text and "Aborted!" not in text and "Traceback" not in text
