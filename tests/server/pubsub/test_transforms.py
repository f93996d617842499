"""The transform engine: UDF contract, filtering, chains, failures, limits, compression, validation."""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib

import pytest
import zstandard
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import transforms
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._pubsub.transforms import Pipeline, TransformFailed, check_transforms, steps_of

#: A validation case that compiles its UDF (so needs QuickJS).
COMPILES = pytest.mark.quickjs
PubsubMessage = pubsub_types.PubsubMessage.pb()
MessageTransform = pubsub_types.MessageTransform.pb()

REDACT = """
function redact(message, metadata) {
  const data = JSON.parse(message.data);
  delete data.ssn;
  message.data = JSON.stringify(data);
  message.attributes.seen = metadata.message_id || "none";
  return message;
}"""


def udf(code: str, name: str, disabled: bool = False) -> object:
    return MessageTransform(javascript_udf={"code": code, "function_name": name}, disabled=disabled)


def compression(algorithm: str, mode: str) -> object:
    return MessageTransform(compression={"compression_algorithm": algorithm, "compression_mode": mode})


def message(data: bytes = b"", **attributes: str) -> object:
    return PubsubMessage(data=data, attributes=attributes, message_id="42", ordering_key="k")


@pytest.mark.quickjs
def test_redaction_udf_gets_data_as_text_and_metadata() -> None:
    original = message(json.dumps({"name": "ana", "ssn": "123"}).encode(), kind="person")
    out = Pipeline([udf(REDACT, "redact")]).apply(original)
    assert json.loads(out.data) == {"name": "ana"}
    assert dict(out.attributes) == {"kind": "person", "seen": "42"}
    assert out.ordering_key == "k" and out.message_id == "42"
    assert b"ssn" in original.data  # the input is left as it was


@pytest.mark.quickjs
def test_metadata_carries_publish_time_and_ordering_key() -> None:
    code = "function meta(m, md) { return {data: JSON.stringify(md)}; }"
    original = message(b"x")
    original.publish_time.FromJsonString("2026-03-04T05:06:07.5Z")
    out = Pipeline([udf(code, "meta")]).apply(original)
    assert json.loads(out.data) == {
        "message_id": "42",
        "publish_time": "2026-03-04T05:06:07Z",
        "ordering_key": "k",
    }
    assert dict(out.attributes) == {}  # absent attributes keep the message's (it had none)


@pytest.mark.quickjs
def test_null_filters_and_attributes_rules() -> None:
    code = """
function route(message, metadata) {
  if (message.attributes.drop) return null;
  if (message.attributes.clear) return {data: message.data, attributes: {}};
  return {data: message.data.toUpperCase()};
}"""
    pipeline = Pipeline([udf(code, "route")])
    assert pipeline.apply(message(b"a", drop="1")) is None
    assert dict(pipeline.apply(message(b"a", clear="1")).attributes) == {}
    kept = pipeline.apply(message(b"abc", keep="1"))
    assert kept.data == b"ABC" and dict(kept.attributes) == {"keep": "1"}


@pytest.mark.quickjs
def test_chain_runs_in_order_and_skips_disabled() -> None:
    first = "function first(m) { m.data = m.data + '1'; return m; }"
    second = "function second(m) { m.data = m.data + '2'; return m; }"
    never = "function never(m) { return null; }"
    pipeline = Pipeline([udf(first, "first"), udf(never, "never", disabled=True), udf(second, "second")])
    assert pipeline.apply(message(b"x")).data == b"x12"
    steps = pipeline.trace(message(b"x"))
    assert [(step.index, step.message.data) for step in steps] == [(0, b"x1"), (2, b"x12")]
    assert steps_of([udf(never, "never", disabled=True)]) == []


@pytest.mark.quickjs
@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("function f(m) { throw new Error('boom'); }", "f threw: Error: boom"),
        ("function f(m) { return 'text'; }", "f returned string"),
        ("function f(m) { return [m]; }", "f returned array"),
        ("function f(m) { }", "f returned undefined"),
        ("function f(m) { return {data: 5}; }", "'data' is not a string"),
        ("function f(m) { return {data: 'x', attributes: {a: 1}}; }", "not an object of strings"),
        ("function f(m) { return {data: '', attributes: {}}; }", "not a valid message"),
    ],
)
def test_failures_name_the_transform_and_reason(code: str, reason: str) -> None:
    pipeline = Pipeline([udf("function ok(m) { return m; }", "ok"), udf(code, "f")])
    with pytest.raises(TransformFailed) as caught:
        pipeline.apply(message(b"x"))
    assert caught.value.index == 1
    assert reason in caught.value.reason
    assert pipeline.trace(message(b"x"))[-1].error is not None


@pytest.mark.quickjs
def test_data_that_is_not_utf8_fails_a_udf() -> None:
    with pytest.raises(TransformFailed, match="not UTF-8"):
        Pipeline([udf("function f(m) { return m; }", "f")]).apply(message(b"\xff\xfe"))


@pytest.mark.quickjs
def test_endless_loop_and_huge_allocation_fail_that_message_only() -> None:
    code = """
function spin(m) { if (m.attributes.spin) { while (true) {} } return m; }
function hog(m) {
  var a = [];
  if (m.attributes.hog) { while (true) a.push('x'.repeat(1e6) + a.length); }
  return m;
}"""
    spin = Pipeline([udf(code, "spin")])
    hog = Pipeline([udf(code, "hog")])
    started = time.process_time()
    with pytest.raises(TransformFailed, match="interrupted"):
        spin.apply(message(b"x", spin="1"))
    # The limit counts CPU time; a little over it is the interrupt check's granularity.
    assert time.process_time() - started < transforms.UDF_TIME_LIMIT_SECONDS * 3
    assert spin.apply(message(b"next")).data == b"next"
    with pytest.raises(TransformFailed, match="out of memory"):
        hog.apply(message(b"x", hog="1"))
    assert hog.apply(message(b"after")).data == b"after"
    deep = Pipeline(
        [udf("function deep(m) { function r(n) { return n ? r(n - 1) : 0; } r(1e6); return m; }", "deep")]
    )
    with pytest.raises(TransformFailed, match="stack overflow"):
        deep.apply(message(b"x"))


@pytest.mark.quickjs
def test_a_pipeline_made_in_one_thread_runs_in_another() -> None:
    code = "function f(m) { function r(n) { return n ? r(n - 1) : 0; } r(100); return m; }"
    pipeline = Pipeline([udf(code, "f")])
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(pipeline.apply(message(b"x")).data))
    worker.start()
    worker.join(10)
    assert results == [b"x"]


@pytest.mark.quickjs
def test_udf_has_no_file_network_or_module_access() -> None:
    code = """
function probe(m) {
  return {data: [typeof require, typeof std, typeof os, typeof fetch, typeof XMLHttpRequest,
                 typeof process].join(',')};
}"""
    out = Pipeline([udf(code, "probe")]).apply(message(b"x"))
    assert out.data == b"undefined,undefined,undefined,undefined,undefined,undefined"


@pytest.mark.parametrize("algorithm", ["ZLIB", "ZSTD"])
def test_compression_round_trip(algorithm: str) -> None:
    data = b"hello " * 1000
    compressed = Pipeline([compression(algorithm, "COMPRESS")]).apply(message(data))
    assert len(compressed.data) < len(data)
    expected = (
        zlib.decompress(compressed.data) if algorithm == "ZLIB" else zstandard.decompress(compressed.data)
    )
    assert expected == data
    both = Pipeline([compression(algorithm, "COMPRESS"), compression(algorithm, "DECOMPRESS")])
    assert both.apply(message(data)).data == data


@pytest.mark.parametrize("algorithm", ["ZLIB", "ZSTD"])
def test_decompressing_bad_or_cut_data_fails(algorithm: str) -> None:
    pipeline = Pipeline([compression(algorithm, "DECOMPRESS")])
    with pytest.raises(TransformFailed, match="could not decompress"):
        pipeline.apply(message(b"not compressed at all"))
    good = zlib.compress(b"abc" * 100) if algorithm == "ZLIB" else zstandard.compress(b"abc" * 100)
    with pytest.raises(TransformFailed, match="could not decompress"):
        pipeline.apply(message(good[:-4]))


def test_decompression_bomb_is_stopped_at_the_message_limit() -> None:
    bomb = zlib.compress(b"\0" * (11 * 1024 * 1024))
    with pytest.raises(TransformFailed, match="more than"):
        Pipeline([compression("ZLIB", "DECOMPRESS")]).apply(message(bomb))


@pytest.mark.parametrize(
    ("transforms_given", "reason"),
    [
        pytest.param([udf("function f(m) {", "f")], "does not run: SyntaxError", marks=COMPILES),
        pytest.param([udf("function g(m) { return m; }", "f")], "no function named 'f'", marks=COMPILES),
        pytest.param([udf("var f = 3;", "f")], "typeof f is number", marks=COMPILES),
        ([udf("function f(m) { return m; }", "f; evil()")], "is not a JavaScript name"),
        ([udf("", "f")], "code is required"),
        ([udf("function f(m) {}", "")], "function_name is required"),
        ([udf("// " + "x" * 21000 + "\nfunction f(m) {}", "f")], "at most 20480"),
        pytest.param([udf("function f(m) { return m; }", "f")] * 2, "already used", marks=COMPILES),
        ([compression("ZLIB", "COMPRESSION_MODE_UNSPECIFIED")], "compression_mode"),
        ([compression("COMPRESSION_ALGORITHM_UNSPECIFIED", "COMPRESS")], "compression_algorithm"),
        ([MessageTransform()], "one of javascript_udf"),
        ([compression("ZLIB", "COMPRESS")] * 6, "at most 5"),
    ],
)
def test_validation_refuses_with_the_reason(transforms_given: list[object], reason: str) -> None:
    with pytest.raises(ServiceError) as caught:
        check_transforms(transforms_given)
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    assert reason in caught.value.message


def test_ai_inference_is_checked_then_refused_by_name() -> None:
    with pytest.raises(ServiceError) as caught:
        check_transforms([MessageTransform(ai_inference={})])
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as caught:
        check_transforms([MessageTransform(ai_inference={"endpoint": "projects/p/locations/l/endpoints/e"})])
    assert caught.value.code == StatusCode.UNIMPLEMENTED
    assert "ai_inference" in caught.value.message


def test_without_quickjs_compiling_a_udf_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "quickjs", None)  # as where it is not installed
    with pytest.raises(ServiceError) as caught:
        check_transforms([compression("ZLIB", "COMPRESS"), udf(REDACT, "redact")])
    assert caught.value.code == StatusCode.FAILED_PRECONDITION
    assert caught.value.message.startswith("message_transforms[1]: JavaScript UDFs run in QuickJS")
    assert "pip install 'hedgepub[server]'" in caught.value.message
    check_transforms([compression("ZLIB", "COMPRESS")])  # compression needs no QuickJS
