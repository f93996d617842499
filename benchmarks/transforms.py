"""Message transforms: the cost of a small JavaScript UDF per message, and publishing with and without one.

Two parts, each in interleaved rounds (the order of the targets alternates, so a busy machine hurts all
alike), each printing medians with [min-max] over the rounds and the load average before and after:

1. **Engine** (in this process): a redaction UDF (parse the JSON data, delete a field, serialize it) on
   one message, through hedgepub's transform pipeline on QuickJS (``quickjs``, the engine the server
   uses) and, when ``mini-racer`` is installed, the same UDF and JSON hand-over through V8
   (``py_mini_racer``), the other candidate: microseconds per message, of wall clock and of this
   process's CPU time (the one to trust on a busy machine). Then the same UDF through the server's
   sandbox (:class:`~hedgepub.server._pubsub.transforms.Transforms`: worker processes over pipes), in
   requests of one message and of ``--batch``: wall clock and CPU time of this process plus the
   workers', side by side with the in-process figure as a ratio.
2. **Publish** (``hedgepub serve --in-memory --no-rest``, a fresh process per target and round): raw-gRPC
   Publish requests of ``--batch`` JSON messages from ``--publishers`` callers, to a topic
   - ``plain``: without transforms (this tree);
   - ``udf``: with the redaction UDF as a topic transform (this tree);
   - ``baseline``: without transforms, on an older hedgepub (``--baseline-src``, e.g. the tree before
     transforms existed: ``git worktree add /tmp/before <commit>``, then ``--baseline-src /tmp/before/src``).
   Printed: messages/s and the server's CPU time per message (user + system, from /proc), which a busy
   machine disturbs far less than the wall clock.

    python benchmarks/transforms.py                              # engine + plain and udf
    python benchmarks/transforms.py --baseline-src /tmp/before/src --rounds 7
    python benchmarks/transforms.py --parts engine --calls 50000
    python benchmarks/transforms.py --parts sandbox --calls 5000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc.aio
from google.pubsub_v1.types import pubsub as pubsub_types

from server_ingest import (
    PublishRequest,
    PubsubMessage,
    ServerProcess,
    Subscription,
    Topic,
    _serializer,
    cpu_seconds,
    load_average,
    publish_requests,
    spread,
)

REDACT = """
function redactSSN(message, metadata) {
  const data = JSON.parse(message.data);
  delete data['ssn'];
  message.data = JSON.stringify(data);
  return message;
}"""
DATA = json.dumps({"name": "Ana Lima", "ssn": "123-45-6789", "city": "Porto", "orders": [1, 2, 3]}).encode()
MessageTransform: Any = pubsub_types.MessageTransform.pb()
TOPIC = "projects/bench/topics/transforms"
SUBSCRIPTION = "projects/bench/subscriptions/transforms-sub"


def _quickjs_call() -> Any:
    from hedgepub.server._pubsub.transforms import Pipeline

    pipeline = Pipeline([MessageTransform(javascript_udf={"code": REDACT, "function_name": "redactSSN"})])
    message = PubsubMessage(data=DATA, attributes={"kind": "person"}, message_id="1")
    return lambda: pipeline.apply(message)


def _mini_racer_call() -> Any | None:
    try:
        from py_mini_racer import MiniRacer
    except ImportError:
        return None
    context = MiniRacer()
    context.eval(REDACT)
    context.eval(
        "function invoke(m, md) { var r = redactSSN(JSON.parse(m), JSON.parse(md)); "
        "return r === null ? null : JSON.stringify(r); }"
    )
    text = DATA.decode()

    def call() -> Any:
        # The same hand-over as hedgepub's: JSON text in, JSON text out, bytes rebuilt on the way back.
        out = context.call(
            "invoke", json.dumps({"data": text, "attributes": {"kind": "person"}}), '{"message_id": "1"}'
        )
        returned = json.loads(out)
        return PubsubMessage(data=returned["data"].encode(), attributes=returned["attributes"])

    call.close = context.close  # type: ignore[attr-defined]
    return call


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (V8 runs the UDF on a thread of its own)."""
    return time.process_time()


def engine(args: argparse.Namespace) -> None:
    calls = {"quickjs": _quickjs_call()}
    mini_racer = _mini_racer_call()
    if mini_racer is not None:
        calls["mini-racer (V8)"] = mini_racer
    else:
        print("mini-racer is not installed: QuickJS alone (pip install mini-racer to compare).")
    results: dict[str, list[float]] = {name: [] for name in calls}
    cpu_results: dict[str, list[float]] = {name: [] for name in calls}
    print(f"Engine: {args.calls} calls per round, {args.rounds} rounds; load average {load_average()}")
    for round_number in range(args.rounds):
        order = list(calls) if round_number % 2 == 0 else list(reversed(calls))
        for name in order:
            call = calls[name]
            for _ in range(min(1000, args.calls)):  # warm the engine (JIT, caches) outside the timing
                call()
            started, cpu_started = time.perf_counter(), _cpu_seconds()
            for _ in range(args.calls):
                call()
            results[name].append((time.perf_counter() - started) / args.calls * 1e6)
            cpu_results[name].append((_cpu_seconds() - cpu_started) / args.calls * 1e6)
    for name, values in results.items():
        cpu_text = spread(cpu_results[name], ",.1f")
        print(f"  {name:16} {spread(values, ',.1f')} us/message wall, {cpu_text} us CPU")
    print(f"  load average after: {load_average()}")
    if mini_racer is not None:
        mini_racer.close()


async def _create(address: str, transforms: list[Any]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        create_topic = channel.unary_unary(
            "/google.pubsub.v1.Publisher/CreateTopic", request_serializer=_serializer
        )
        await create_topic(Topic(name=TOPIC, message_transforms=transforms), timeout=30)
        create = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/CreateSubscription", request_serializer=_serializer
        )
        await create(Subscription(name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=600), timeout=30)


def publish(args: argparse.Namespace) -> None:
    targets = ["plain", "udf"] + (["baseline"] if args.baseline_src else [])
    request = PublishRequest(
        topic=TOPIC,
        messages=[PubsubMessage(data=DATA, attributes={"kind": "person"}) for _ in range(args.batch)],
    ).SerializeToString()
    udf = [MessageTransform(javascript_udf={"code": REDACT, "function_name": "redactSSN"})]
    rates: dict[str, list[float]] = {target: [] for target in targets}
    cpu: dict[str, list[float]] = {target: [] for target in targets}
    print(
        f"\nPublish: {args.messages} messages of {len(DATA)} bytes per run, batches of {args.batch}, "
        f"{args.publishers} publishers, {args.rounds} rounds; load average {load_average()}"
    )
    for round_number in range(args.rounds):
        order = targets if round_number % 2 == 0 else list(reversed(targets))
        for target in order:
            source = Path(args.baseline_src) if target == "baseline" else None
            server = ServerProcess("memory", source=source, rest=False)
            server.start()
            try:
                asyncio.run(_create(server.address, udf if target == "udf" else []))
                before = server.cpu_seconds()
                run = asyncio.run(
                    publish_requests(
                        server.address, max(1, args.messages // args.batch), args.publishers, request
                    )
                )
                after = server.cpu_seconds()
            finally:
                server.stop()
            rates[target].append(run.messages_per_second)
            if before is not None and after is not None:
                cpu[target].append((after - before) / run.messages * 1e6)
            print(f"  round {round_number + 1} {target:9} {run.messages_per_second:9,.0f} msg/s")
    print("Summary (median [min-max]):")
    for target in targets:
        cpu_text = f"{spread(cpu[target], ',.1f')} us server CPU/message" if cpu[target] else "n/a"
        print(f"  {target:9} {spread(rates[target])} msg/s   {cpu_text}")
    if cpu["plain"] and cpu["udf"]:
        added = [udf_cpu - plain_cpu for udf_cpu, plain_cpu in zip(cpu["udf"], cpu["plain"], strict=True)]
        print(f"  the UDF adds {spread(added, ',.1f')} us of server CPU per message (paired by round)")
    print(f"  load average after: {load_average()}")


def _sandbox_round(calls: int, batch: int) -> tuple[float, float]:
    """Wall and CPU (this process and the workers) microseconds per message through the sandbox."""
    from hedgepub.server._pubsub.transforms import Transforms

    transforms = [MessageTransform(javascript_udf={"code": REDACT, "function_name": "redactSSN"})]
    messages = [PubsubMessage(data=DATA, attributes={"kind": "person"}, message_id="1")] * batch

    async def run() -> tuple[float, float]:
        runner = Transforms()
        try:
            for _ in range(20):  # start the workers and compile the UDF outside the timing
                await runner.apply(TOPIC, transforms, messages)
            pool = runner._pool()
            pids = pool.worker_pids()
            worker_cpu = sum(cpu_seconds(pid) or 0.0 for pid in pids)
            started, cpu_started = time.perf_counter(), _cpu_seconds()
            for _ in range(max(1, calls // batch)):
                await runner.apply(TOPIC, transforms, messages)
            wall = time.perf_counter() - started
            cpu = _cpu_seconds() - cpu_started + sum(cpu_seconds(pid) or 0.0 for pid in pids) - worker_cpu
            done = max(1, calls // batch) * batch
            return wall / done * 1e6, cpu / done * 1e6
        finally:
            await runner.close()

    return asyncio.run(run())


def sandbox(args: argparse.Namespace) -> None:
    inline = _quickjs_call()
    targets = ["in-process", "sandbox, 1 a request", f"sandbox, {args.batch} a request"]
    wall: dict[str, list[float]] = {target: [] for target in targets}
    cpu: dict[str, list[float]] = {target: [] for target in targets}
    print(f"\nSandbox: {args.calls} messages per round, {args.rounds} rounds; load average {load_average()}")
    for round_number in range(args.rounds):
        order = targets if round_number % 2 == 0 else list(reversed(targets))
        for target in order:
            if target == "in-process":
                for _ in range(200):
                    inline()
                started, cpu_started = time.perf_counter(), _cpu_seconds()
                for _ in range(args.calls):
                    inline()
                wall[target].append((time.perf_counter() - started) / args.calls * 1e6)
                cpu[target].append((_cpu_seconds() - cpu_started) / args.calls * 1e6)
            else:
                batch = 1 if target == "sandbox, 1 a request" else args.batch
                seconds, cpu_seconds_ = _sandbox_round(args.calls, batch)
                wall[target].append(seconds)
                cpu[target].append(cpu_seconds_)
    base_cpu = sorted(cpu["in-process"])[len(cpu["in-process"]) // 2]
    for target in targets:
        ratio = sorted(cpu[target])[len(cpu[target]) // 2] / base_cpu
        print(
            f"  {target:22} {spread(wall[target], ',.1f')} us/message wall, "
            f"{spread(cpu[target], ',.1f')} us CPU (x{ratio:.1f} the in-process CPU)"
        )
    print(f"  load average after: {load_average()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default="engine,sandbox,publish", help="engine, sandbox, publish (default: all three)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20_000, help="engine: UDF calls per round and engine")
    parser.add_argument("--messages", type=int, default=50_000, help="publish: messages per run")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--baseline-src", default=None, help="publish: an older hedgepub's src/ directory")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if "engine" in parts:
        engine(args)
    if "sandbox" in parts:
        sandbox(args)
    if "publish" in parts:
        publish(args)


if __name__ == "__main__":
    main()
