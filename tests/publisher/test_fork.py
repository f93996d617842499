"""A PublisherClient made before os.fork(), used in the child: it works or refuses at once, never hangs.

Each scenario runs in a fresh interpreter (the test process runs gRPC servers on threads, which a forked
copy of it could not use), against the local server of this test, under a time limit: a hang fails the
test instead of blocking the suite. The child ends through the interpreter's normal exit, so the implicit
flush at exit is part of what is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hedgepub.bench import AdminClient
from hedgepub.server import LocalServer

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")

#: Seconds a scenario may take in all; each does a few publishes on a local server.
LIMIT = 60

_PRELUDE = """
import json, multiprocessing, os, sys, time
from hedgepub import BatchSettings, PublishError, PublisherClient

address, topic = sys.argv[1], sys.argv[2]
report = {}


def in_child(body):
    # Fork; the child runs body(seen), writes what it saw to a file and leaves through sys.exit, so the
    # interpreter's normal exit (and its flush) runs. Returns the child's exit code and what it saw.
    path = os.path.join(os.environ["HEDGEPUB_REPORT_DIR"], "child-%d.json" % time.monotonic_ns())
    pid = os.fork()
    if pid == 0:
        started = time.monotonic()
        seen = {}
        try:
            body(seen)
        except BaseException as error:
            seen["crashed"] = repr(error)
        seen["seconds"] = round(time.monotonic() - started, 3)
        with open(path, "w") as file:
            json.dump(seen, file)
        sys.exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with open(path) as file:
        return status, json.load(file)
"""


class _Scenario:
    """Runs scenario scripts against this test's server and topic, and reads what the topic stored."""

    def __init__(self, server: LocalServer, topic: str, report_dir: Path) -> None:
        self.server = server
        self.topic = topic
        self.report_dir = report_dir

    def run(self, script: str) -> dict[str, Any]:
        """Run ``script`` after the prelude in a fresh interpreter; return its ``report``."""
        code = _PRELUDE + textwrap.dedent(script) + "\nprint(json.dumps(report))\n"
        env = {**os.environ, "HEDGEPUB_REPORT_DIR": str(self.report_dir)}
        # A session of its own, so that a hang can be ended with its forked children, not only the script.
        process = subprocess.Popen(
            [sys.executable, "-c", code, self.server.address, self.topic],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"the scenario hung: still running after {LIMIT} s")
        assert process.returncode == 0, stderr[-3000:]
        return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def stored(self) -> list[bytes]:
        """The data of every message stored on the topic, sorted."""
        return sorted(message.data for message in self.server.messages(self.topic))


@pytest.fixture
def scenario(pubsub_server: LocalServer, tmp_path: Path) -> _Scenario:
    """The scenario runner, on the topic ``forked`` (its id is in the span names the traced test reads)."""
    name = "projects/test-project/topics/forked"
    with AdminClient(pubsub_server.address) as admin:
        admin.create_topic(name)
    return _Scenario(pubsub_server, name, tmp_path)


def test_a_client_that_never_published_works_in_the_forked_child(scenario: _Scenario) -> None:
    report = scenario.run(
        """
        publisher = PublisherClient(endpoint=address)  # made before the fork, as gunicorn --preload does


        def body(seen):
            seen["ids"] = [publisher.publish(topic, b"child-%d" % n).result(timeout=20) for n in range(3)]
            publisher.publish(topic, b"child-left-to-exit")  # flushed by the implicit shutdown at exit


        report["child_status"], report["child"] = in_child(body)
        report["parent"] = publisher.publish(topic, b"parent").result(timeout=20)
        publisher.shutdown()
        """,
    )
    assert report["child_status"] == 0
    child = report["child"]
    assert "crashed" not in child, child
    assert len(set(child["ids"])) == 3
    assert scenario.stored() == [
        b"child-0",
        b"child-1",
        b"child-2",
        b"child-left-to-exit",
        b"parent",
    ]


def test_a_client_connected_before_the_fork_refuses_at_once_and_never_hangs(scenario: _Scenario) -> None:
    report = scenario.run(
        """
        publisher = PublisherClient(endpoint=address, batch_settings=BatchSettings(max_latency=1.0))
        publisher.publish(topic, b"before").result(timeout=20)  # the channel is open now
        pending = publisher.publish(topic, b"pending-at-fork")  # its batch waits 1 s for more


        def body(seen):
            seen["inherited_done"] = pending.done()
            seen["inherited_error"] = repr(pending.exception(timeout=0))
            try:
                publisher.publish(topic, b"from-child")
            except RuntimeError as error:
                seen["refused"] = str(error)
            publisher.shutdown()  # returns at once: nothing to wait for here


        report["child_status"], report["child"] = in_child(body)
        report["parent_pending"] = pending.result(timeout=20)
        publisher.shutdown()
        """,
    )
    assert report["child_status"] == 0
    child = report["child"]
    assert child["inherited_done"] is True, child
    assert "before os.fork()" in child["inherited_error"]
    # The advice is one that works (the tests below follow it): not "create the client in the child",
    # which hangs or crashes in gRPC in such a child.
    refused = child["refused"]
    assert "os.fork()" in refused and "a new client made in this child would hang or crash" in refused
    assert "'spawn' or 'forkserver'" in refused and "shut every client down before forking" in refused
    assert child["seconds"] < 5
    # The parent still owns the pending message and publishes it, once.
    assert scenario.stored() == [b"before", b"pending-at-fork"]


def test_a_pending_future_of_a_dropped_client_fails_at_once_in_the_forked_child(scenario: _Scenario) -> None:
    report = scenario.run(
        """
        import gc

        # Nothing references the client but its pending publish (its batch waits 1 s for more).
        publisher = PublisherClient(endpoint=address, batch_settings=BatchSettings(max_latency=1.0))
        pending = publisher.publish(topic, b"pending-at-fork")
        del publisher
        gc.collect()


        def body(seen):
            seen["inherited_error"] = repr(pending.exception(timeout=5))


        report["child_status"], report["child"] = in_child(body)
        report["parent_pending"] = pending.result(timeout=20)
        """,
    )
    assert report["child_status"] == 0
    child = report["child"]
    assert "before os.fork()" in child["inherited_error"], child
    assert child["seconds"] < 5
    assert scenario.stored() == [b"pending-at-fork"]  # the parent published it, once


def test_a_multiprocessing_fork_pool_publishes_through_a_client_made_before_it(scenario: _Scenario) -> None:
    report = scenario.run(
        """
        publisher = PublisherClient(endpoint=address)


        def work(number):
            return publisher.publish(topic, b"worker-%d" % number).result(timeout=20)


        if __name__ == "__main__":
            with multiprocessing.get_context("fork").Pool(2) as pool:
                report["ids"] = pool.map(work, range(6))
            publisher.shutdown()
        """,
    )
    assert len(set(report["ids"])) == 6
    assert scenario.stored() == [b"worker-%d" % number for number in range(6)]


def test_a_traced_client_made_before_the_fork_traces_the_child_publishes_with_the_child_core(
    scenario: _Scenario,
) -> None:
    report = scenario.run(
        """
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        publisher = PublisherClient(endpoint=address, enable_open_telemetry=True, tracer_provider=provider)


        def body(seen):
            seen["id"] = publisher.publish(topic, b"traced-child").result(timeout=20)
            publisher.shutdown()
            finished = spans.get_finished_spans()
            seen["spans"] = sorted(span.name for span in finished)
            creates = {span.context.span_id for span in finished if span.name.endswith(" create")}
            batches = [span for span in finished if span.name.endswith(" publish")]
            linked = {link.context.span_id for span in batches for link in span.links}
            seen["create_linked_to_publish"] = bool(creates) and creates <= linked


        report["child_status"], report["child"] = in_child(body)
        publisher.shutdown()
        """,
    )
    child = report["child"]
    assert report["child_status"] == 0 and "crashed" not in child, child
    names = child["spans"]
    assert "forked create" in names and "forked publish" in names, names
    # The child's batch span links the child's create span: both come from the child's own core.
    assert child["create_linked_to_publish"] is True, child
    assert scenario.stored() == [b"traced-child"]


_WORKER = """
from hedgepub import PublisherClient


def work(address, topic, number):
    # A worker process of its own: its client is made here, after the parent published.
    with PublisherClient(endpoint=address) as publisher:
        return publisher.publish(topic, b"worker-%d" % number).result(timeout=20)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_after_a_publish_spawn_and_forkserver_workers_publish_with_their_own_clients(
    scenario: _Scenario, method: str
) -> None:
    (scenario.report_dir / "fork_worker.py").write_text(_WORKER)
    report = scenario.run(
        f"""
        import functools
        sys.path.insert(0, os.environ["HEDGEPUB_REPORT_DIR"])  # the workers import fork_worker from here
        import fork_worker

        publisher = PublisherClient(endpoint=address)
        publisher.publish(topic, b"parent-before").result(timeout=20)  # the parent's channel is open


        if __name__ == "__main__":
            with multiprocessing.get_context("{method}").Pool(2) as pool:
                report["ids"] = pool.map(functools.partial(fork_worker.work, address, topic), range(4))
            publisher.publish(topic, b"parent-after").result(timeout=20)
            publisher.shutdown()
        """,
    )
    assert len(set(report["ids"])) == 4
    expected = [b"parent-after", b"parent-before", *(b"worker-%d" % number for number in range(4))]
    assert scenario.stored() == expected


def test_after_a_publish_and_a_shutdown_a_client_made_in_the_forked_child_publishes(
    scenario: _Scenario,
) -> None:
    report = scenario.run(
        """
        publisher = PublisherClient(endpoint=address)
        publisher.publish(topic, b"parent").result(timeout=20)
        publisher.shutdown()  # no channel open at the fork


        def body(seen):
            with PublisherClient(endpoint=address) as own:
                seen["ids"] = [own.publish(topic, b"child-%d" % n).result(timeout=20) for n in range(3)]


        report["child_status"], report["child"] = in_child(body)
        """,
    )
    assert report["child_status"] == 0
    child = report["child"]
    assert "crashed" not in child, child
    assert len(set(child["ids"])) == 3
    assert scenario.stored() == [b"child-0", b"child-1", b"child-2", b"parent"]
