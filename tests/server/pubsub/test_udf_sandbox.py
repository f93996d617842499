"""The transforms sandbox on its own: real worker processes, the contexts they keep bounded in bytes and
released with their resource, a worker that dies failing only the message it ran, budgets per request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hedgepub.server._pubsub import udf_engine
from hedgepub.server._pubsub.udf_sandbox import NOT_RUN, Sandbox

pytestmark = pytest.mark.quickjs  # every test runs UDFs in worker processes

HOLD = "var kept = 'x'.repeat(40 * 1024 * 1024); function f(m){ return m; }"
MIB = 1024 * 1024


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _steps(code: str) -> list[udf_engine.Step]:
    return [("udf", 0, code, "f")]


def test_kept_contexts_are_bounded_in_bytes_and_released_with_their_resource() -> None:
    async def scenario() -> tuple[int, int, int]:
        sandbox = Sandbox(workers=1, context_bytes=60 * MIB)
        try:
            await sandbox.run(
                ("projects/p/topics/base", "d"), _steps("function f(m){ return m; }"), [(b"x", {}, {})]
            )
            (pid,) = sandbox.worker_pids()
            base = _rss(pid)
            for index in range(6):  # 6 x 40 MiB held, over a bound of 60 MiB
                key = (f"projects/p/topics/holder-{index}", "d")
                (outcome,) = await sandbox.run(key, _steps(HOLD), [(b"x", {}, {})])
                assert outcome[-1][1][0] == "ok", outcome
            bounded = _rss(pid) - base
            for index in range(6):
                await sandbox.forget(f"projects/p/topics/holder-{index}")
            await sandbox.run(
                ("projects/p/topics/base", "d"), _steps("function f(m){ return m; }"), [(b"x", {}, {})]
            )
            return base, bounded, _rss(pid) - base
        finally:
            await sandbox.close()

    _, bounded, released = asyncio.run(scenario())
    assert bounded < 130 * MIB, f"{bounded / MIB:.0f} MiB held by 6 contexts of 40 MiB under a 60 MiB bound"
    assert released < 20 * MIB, f"{released / MIB:.0f} MiB still held after the resources were forgotten"


def test_a_worker_that_dies_fails_only_its_message_and_is_replaced() -> None:
    # QuickJS does not interrupt a backtracking regular expression: RLIMIT_CPU ends the worker (SIGXCPU).
    backtrack = "function f(m){ if (m.attributes.bomb) /(a+)+$/.test(m.data); return m; }"

    async def scenario() -> tuple[list[tuple[str, str]], list[object]]:
        sandbox = Sandbox(workers=1)
        try:
            key = ("projects/p/topics/backtrack", "d")
            messages = [(b"before", {}, {}), (b"a" * 40 + b"!", {"bomb": "1"}, {}), (b"after", {}, {})]
            first = await sandbox.run(key, _steps(backtrack), messages, budget=0.5)
            second = await sandbox.run(key, _steps(backtrack), [(b"next", {}, {})])
            return [(o[-1][1][0], str(o[-1][1][1])) for o in first], [o[-1][1] for o in second]
        finally:
            await sandbox.close()

    outcomes, after = asyncio.run(scenario())
    assert [kind for kind, _ in outcomes] == ["ok", "failed", NOT_RUN]
    assert "worker" in outcomes[1][1]
    assert after == [("ok", b"next", {})]


def test_a_request_shares_one_budget() -> None:
    spin = "function f(m){ var x = 0; for (var i = 0; i < 1e6; i++) x += i; return m; }"

    async def scenario() -> list[str]:
        sandbox = Sandbox(workers=1)
        try:
            outcomes = await sandbox.run(None, _steps(spin), [(b"m", {}, {})] * 200, budget=0.3)
            return [outcome[-1][1][0] for outcome in outcomes]
        finally:
            await sandbox.close()

    kinds = asyncio.run(scenario())
    assert kinds[0] == "ok"
    assert kinds[-1] == NOT_RUN and "failed" not in kinds
    assert kinds == sorted(kinds, key=lambda kind: kind == NOT_RUN)  # the ones run first, then not run
