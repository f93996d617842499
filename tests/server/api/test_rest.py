"""The REST face: plain HTTP/1.1 requests against the server's one port, checked route by route.

Three kinds of checks:

- the route table: every gRPC method the official client package calls (read from its generated gRPC
  transports, not from the table) has a REST route, except the bidirectional StreamingPull, which has
  no HTTP rule in the real service either;
- every route, generically: the same call made over REST to one server and over gRPC to a twin server
  (both fresh, both given the same calls in the same order) must give the same answer: the response
  in the proto3 JSON mapping, or Google's JSON error form with the HTTP status of the gRPC code. A
  method another part of the server does not implement yet answers UNIMPLEMENTED (501) on both faces;
- scenarios written from the REST reference (resources, base64 data, durations, camelCase, update
  masks, paging, IAM, errors), with what they do seen through gRPC on the same port.
"""

from __future__ import annotations

import base64
import http.client
import inspect
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.cloud import pubsub_v1
from google.protobuf import json_format

from hedgepub.server import IamConfig, LocalServer
from hedgepub.server._api import grpc as grpc_api
from hedgepub.server._api.rest import Route, routes

PROJECT_ID = "rest-project"
PROJECT = f"projects/{PROJECT_ID}"

#: HTTP status of each gRPC code, as Google's JSON error form gives it (google.rpc.Code's documentation).
HTTP_STATUS = {
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}


class Rest:
    """Plain HTTP/1.1 requests to one server, over one kept-alive connection."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """Send one request; return the status and the decoded JSON answer (text if not JSON)."""
        payload = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        self.connection.request(method, path, body=payload, headers=headers or {})
        response = self.connection.getresponse()
        text = response.read().decode()
        if response.getheader("content-type", "").startswith("application/json"):
            return response.status, json.loads(text)
        return response.status, text

    def close(self) -> None:
        self.connection.close()


def error(status: int, code: str, message: str) -> dict[str, Any]:
    """Google's JSON error form."""
    return {"error": {"code": status, "message": message, "status": code}}


# ------------------------------------------------------------------------------------------- route table


def _grpc_methods_of_the_client_package() -> set[str]:
    """Every ``/package.Service/Method`` path the official client's gRPC transports call."""
    from google.pubsub_v1.services.publisher.transports import grpc as publisher
    from google.pubsub_v1.services.schema_service.transports import grpc as schema_service
    from google.pubsub_v1.services.subscriber.transports import grpc as subscriber

    found: set[str] = set()
    for module in (publisher, subscriber, schema_service):
        found |= set(re.findall(r'"(/google\.[\w.]+/\w+)"', inspect.getsource(module)))
    return found


def test_every_grpc_method_of_the_four_services_has_a_route() -> None:
    grpc_methods = _grpc_methods_of_the_client_package()
    services = {method.split("/")[1] for method in grpc_methods}
    assert services == {
        "google.pubsub.v1.Publisher",
        "google.pubsub.v1.Subscriber",
        "google.pubsub.v1.SchemaService",
        "google.iam.v1.IAMPolicy",
    }
    routed = {route.grpc_method for route in routes()}
    assert grpc_methods - routed == {"/google.pubsub.v1.Subscriber/StreamingPull"}
    assert routed <= grpc_methods


def test_the_table_holds_the_real_http_rules() -> None:
    # A few rules as the REST reference documents them, to catch a table read wrongly.
    table = {(route.http_method, route.template): route for route in routes()}
    assert table["PUT", "/v1/{name=projects/*/topics/*}"].name == "CreateTopic"
    assert table["POST", "/v1/{topic=projects/*/topics/*}:publish"].body == "*"
    assert table["PATCH", "/v1/{subscription.name=projects/*/subscriptions/*}"].path_fields == (
        "subscription.name",
    )
    assert table["POST", "/v1/{parent=projects/*}/schemas"].body == "schema"
    iam_routes = [route for route in routes() if route.grpc_method.startswith("/google.iam.v1.IAMPolicy/")]
    # Get, Set and Test on topics, subscriptions, snapshots and schemas, once each.
    assert len(iam_routes) == 12


# ---------------------------------------------------------------------------- every route, both faces


class Twins:
    """A server answering over REST and a twin answering the same calls over gRPC."""

    def __init__(self, rest_server: LocalServer, grpc_server: LocalServer) -> None:
        self.rest = Rest(rest_server.address)
        self.channel = grpc.insecure_channel(grpc_server.address)

    def grpc_call(self, route: Route, request: Any) -> tuple[str, Any]:
        """The gRPC face's answer: ("OK", response) or (code name, details)."""
        stub = self.channel.unary_unary(
            route.grpc_method,
            request_serializer=route.request_class.SerializeToString,
            response_deserializer=route.response_class.FromString,
        )
        try:
            return "OK", stub(request, timeout=30)
        except grpc.RpcError as failure:
            return failure.code().name, failure.details()

    def close(self) -> None:
        self.rest.close()
        self.channel.close()


@pytest.fixture(scope="module")
def twins() -> Iterator[Twins]:
    with LocalServer(in_memory=True) as rest_server, LocalServer(in_memory=True) as grpc_server:
        pair = Twins(rest_server, grpc_server)
        yield pair
        pair.close()


#: The IDs that fill a template's ``*`` segments, by the collection before them.
IDS = {
    "projects": PROJECT_ID,
    "topics": "generic-topic",
    "subscriptions": "generic-subscription",
    "snapshots": "generic-snapshot",
    "schemas": "generic-schema",
}


def _fill(pattern: str) -> str:
    segments = pattern.split("/")
    return "/".join(IDS[segments[i - 1]] if segment == "*" else segment for i, segment in enumerate(segments))


def _concrete(route: Route) -> tuple[str, dict[str, str]]:
    """A path for ``route`` built from :data:`IDS`, and the request field each variable fills."""
    values: dict[str, str] = {}

    def replace(match: re.Match[str]) -> str:
        value = _fill(match.group(2) or "*")
        values[match.group(1)] = value
        return value

    path = re.sub(r"\{([\w.]+)(?:=([^}]*))?\}", replace, route.template)
    return path, values


def _normalized(document: Any) -> Any:
    """A JSON answer without what differs between two servers given the same calls (times, ack IDs)."""
    if isinstance(document, dict):
        return {
            key: "*" if key in ("publishTime", "ackId") else _normalized(value)
            for key, value in document.items()
        }
    if isinstance(document, list):
        return [_normalized(item) for item in document]
    return document


@pytest.mark.parametrize(
    "route", [pytest.param(route, id=f"{route.http_method} {route.template}") for route in routes()]
)
def test_every_route_answers_as_the_grpc_face_does(twins: Twins, route: Route) -> None:
    path, values = _concrete(route)
    status, document = twins.rest.request(route.http_method, path, {} if route.body else None)

    request = route.request_class()
    for field, value in values.items():
        *parents, last = field.split(".")
        target = request
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, last, value)
    code, answer = twins.grpc_call(route, request)

    if code == "OK":
        assert status == 200, document
        assert _normalized(document) == _normalized(json_format.MessageToDict(answer))
    else:
        assert document == error(HTTP_STATUS[code], code, answer)
        assert status == HTTP_STATUS[code]


# ------------------------------------------------------------------------------------------ scenarios


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with LocalServer(in_memory=True) as local:
        yield local


@pytest.fixture
def rest(server: LocalServer) -> Iterator[Rest]:
    client = Rest(server.address)
    yield client
    client.close()


@pytest.fixture
def clients(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[pubsub_v1.PublisherClient, pubsub_v1.SubscriberClient]]:
    """The official gRPC clients, pointed at the same address as the REST calls."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    yield publisher, subscriber
    publisher.stop()
    subscriber.close()


def test_topics_and_subscriptions_over_rest_are_the_ones_grpc_sees(
    rest: Rest, clients: tuple[pubsub_v1.PublisherClient, pubsub_v1.SubscriberClient]
) -> None:
    publisher, subscriber = clients
    topic, subscription = f"{PROJECT}/topics/orders", f"{PROJECT}/subscriptions/orders-sub"

    status, created = rest.request(
        "PUT", f"/v1/{topic}", {"labels": {"team": "a"}, "messageRetentionDuration": "600s"}
    )
    assert (status, created) == (
        200,
        {"name": topic, "labels": {"team": "a"}, "messageRetentionDuration": "600s"},
    )
    assert publisher.get_topic(topic=topic).message_retention_duration.total_seconds() == 600

    status, created = rest.request(
        "PUT",
        f"/v1/{subscription}",
        {
            "topic": topic,
            "ackDeadlineSeconds": 30,
            "retryPolicy": {"minimumBackoff": "15s", "maximumBackoff": "120s"},
            "enableMessageOrdering": True,
        },
    )
    assert status == 200
    assert created["retryPolicy"] == {"minimumBackoff": "15s", "maximumBackoff": "120s"}
    seen = subscriber.get_subscription(subscription=subscription)
    assert (seen.ack_deadline_seconds, seen.enable_message_ordering) == (30, True)
    assert seen.retry_policy.minimum_backoff.total_seconds() == 15

    # The update mask in the body (as the client libraries send it) and as a query parameter.
    status, updated = rest.request(
        "PATCH", f"/v1/{topic}", {"topic": {"labels": {"team": "b"}}, "updateMask": "labels"}
    )
    assert (status, updated["labels"]) == (200, {"team": "b"})
    status, updated = rest.request(
        "PATCH",
        f"/v1/{subscription}?updateMask=ackDeadlineSeconds",
        {"subscription": {"ackDeadlineSeconds": 45}},
    )
    assert (status, updated["ackDeadlineSeconds"]) == (200, 45)
    assert subscriber.get_subscription(subscription=subscription).ack_deadline_seconds == 45

    status, listed = rest.request("GET", f"/v1/{topic}/subscriptions")
    assert (status, listed) == (200, {"subscriptions": [subscription]})

    assert rest.request("DELETE", f"/v1/{subscription}") == (200, {})
    assert rest.request("DELETE", f"/v1/{topic}") == (200, {})
    assert rest.request("GET", f"/v1/{topic}") == (
        404,
        error(404, "NOT_FOUND", "Resource not found (resource=orders)."),
    )
    assert list(publisher.list_topics(project=PROJECT)) == []


def test_publish_pull_modify_and_acknowledge_over_rest(
    server: LocalServer,
    rest: Rest,
    clients: tuple[pubsub_v1.PublisherClient, pubsub_v1.SubscriberClient],
) -> None:
    publisher, _ = clients
    topic, subscription = f"{PROJECT}/topics/events", f"{PROJECT}/subscriptions/events-sub"
    rest.request("PUT", f"/v1/{topic}", {})
    rest.request("PUT", f"/v1/{subscription}", {"topic": topic})

    data = bytes(range(256))  # every byte value survives base64
    status, published = rest.request(
        "POST",
        f"/v1/{topic}:publish",
        {"messages": [{"data": base64.b64encode(data).decode(), "attributes": {"kind": "binary"}}]},
    )
    assert status == 200 and len(published["messageIds"]) == 1
    grpc_id = publisher.publish(topic, b"through grpc").result(timeout=10)
    assert [message.data for message in server.messages(topic)] == [data, b"through grpc"]

    status, pulled = rest.request(
        "POST", f"/v1/{subscription}:pull", {"maxMessages": 10, "returnImmediately": True}
    )
    assert status == 200
    received = pulled["receivedMessages"]
    assert [base64.b64decode(item["message"]["data"]) for item in received] == [data, b"through grpc"]
    assert received[0]["message"]["attributes"] == {"kind": "binary"}
    assert [item["message"]["messageId"] for item in received] == [published["messageIds"][0], grpc_id]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", received[0]["message"]["publishTime"])

    ack_ids = [item["ackId"] for item in received]
    assert rest.request(
        "POST", f"/v1/{subscription}:modifyAckDeadline", {"ackIds": ack_ids, "ackDeadlineSeconds": 60}
    ) == (200, {})
    assert rest.request("POST", f"/v1/{subscription}:acknowledge", {"ackIds": ack_ids}) == (200, {})
    assert server.wait_until_idle(timeout=5)
    assert rest.request(
        "POST", f"/v1/{subscription}:pull", {"maxMessages": 1, "returnImmediately": True}
    ) == (
        200,
        {},
    )


def test_an_exactly_once_ack_failure_carries_its_error_info_over_rest(rest: Rest) -> None:
    topic, subscription = f"{PROJECT}/topics/payments", f"{PROJECT}/subscriptions/payments-eo"
    rest.request("PUT", f"/v1/{topic}", {})
    status, created = rest.request(
        "PUT", f"/v1/{subscription}", {"topic": topic, "enableExactlyOnceDelivery": True}
    )
    assert (status, created["enableExactlyOnceDelivery"]) == (200, True)
    rest.request("POST", f"/v1/{topic}:publish", {"messages": [{"data": "YQ=="}, {"data": "Yg=="}]})
    status, pulled = rest.request(
        "POST", f"/v1/{subscription}:pull", {"maxMessages": 2, "returnImmediately": True}
    )
    first, second = (item["ackId"] for item in pulled["receivedMessages"])
    assert rest.request("POST", f"/v1/{subscription}:acknowledge", {"ackIds": [first]}) == (200, {})

    # The stale ID (already acknowledged) and a malformed one fail; the valid one is applied all the same.
    status, document = rest.request(
        "POST", f"/v1/{subscription}:acknowledge", {"ackIds": [first, second, "not-an-ack-id"]}
    )
    assert status == 400
    assert document == {
        "error": {
            "code": 400,
            "message": "Some acknowledgement ids in the request were invalid. This could be because the "
            "acknowledgement ids have expired or the acknowledgement ids were malformed.",
            "status": "INVALID_ARGUMENT",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "EXACTLY_ONCE_ACKID_FAILURE",
                    "domain": "pubsub.googleapis.com",
                    "metadata": {
                        first: "PERMANENT_FAILURE_INVALID_ACK_ID",
                        "not-an-ack-id": "PERMANENT_FAILURE_INVALID_ACK_ID",
                    },
                }
            ],
        }
    }
    status, document = rest.request(
        "POST", f"/v1/{subscription}:modifyAckDeadline", {"ackIds": [second], "ackDeadlineSeconds": 60}
    )
    assert status == 400
    [detail] = document["error"]["details"]
    assert detail["metadata"] == {second: "PERMANENT_FAILURE_INVALID_ACK_ID"}
    # An error without details keeps the plain form.
    assert rest.request("GET", f"/v1/{PROJECT}/topics/missing") == (
        404,
        error(404, "NOT_FOUND", "Resource not found (resource=missing)."),
    )


def test_paging_and_query_parameters(rest: Rest) -> None:
    for name in ("alpha", "bravo", "charlie"):
        assert rest.request("PUT", f"/v1/{PROJECT}/topics/{name}", {})[0] == 200
    names: list[str] = []
    token = ""
    pages = 0
    while True:
        # alt=json comes with every gcloud call: a system parameter, ignored.
        query = f"?pageSize=2&alt=json&prettyPrint=false{'&pageToken=' + token if token else ''}"
        status, page = rest.request("GET", f"/v1/{PROJECT}/topics{query}")
        assert status == 200
        names += [topic["name"].rsplit("/", 1)[1] for topic in page["topics"]]
        pages += 1
        token = page.get("nextPageToken", "")
        if not token:
            break
    assert (sorted(names), pages) == (["alpha", "bravo", "charlie"], 2)


#: How each resource type is created over REST (verb, path, body), on a topic and subscription that exist.
_CREATE_OVER_REST: dict[str, Callable[[str], tuple[str, str, Any]]] = {
    "topics": lambda name: ("PUT", f"/v1/{name}", {}),
    "subscriptions": lambda name: ("PUT", f"/v1/{name}", {"topic": f"{PROJECT}/topics/base"}),
    "snapshots": lambda name: ("PUT", f"/v1/{name}", {"subscription": f"{PROJECT}/subscriptions/base"}),
    "schemas": lambda name: (
        "POST",
        f"/v1/{PROJECT}/schemas?schemaId={name.rsplit('/', 1)[1]}",
        {"type": "AVRO", "definition": json.dumps({"type": "record", "name": "R", "fields": []})},
    ),
}


@pytest.mark.parametrize("kind", sorted(_CREATE_OVER_REST))
def test_iam_policy_over_rest(rest: Rest, kind: str) -> None:
    rest.request("PUT", f"/v1/{PROJECT}/topics/base", {})
    rest.request("PUT", f"/v1/{PROJECT}/subscriptions/base", {"topic": f"{PROJECT}/topics/base"})
    resource = f"{PROJECT}/{kind}/guarded"
    policy = {"bindings": [{"role": "roles/pubsub.viewer", "members": ["user:ann@example.com"]}]}
    status, missing = rest.request("POST", f"/v1/{resource}:setIamPolicy", {"policy": policy})
    assert (status, missing["error"]["status"]) == (404, "NOT_FOUND")
    assert rest.request(*_CREATE_OVER_REST[kind](resource))[0] == 200
    status, stored = rest.request("POST", f"/v1/{resource}:setIamPolicy", {"policy": policy})
    assert status == 200 and stored["bindings"] == policy["bindings"]
    status, read = rest.request("GET", f"/v1/{resource}:getIamPolicy?options.requestedPolicyVersion=3")
    assert (status, read["bindings"], read["etag"]) == (200, policy["bindings"], stored["etag"])
    permission = f"pubsub.{kind}.get"
    status, tested = rest.request("POST", f"/v1/{resource}:testIamPermissions", {"permissions": [permission]})
    assert (status, tested) == (200, {"permissions": [permission]})


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "message"),
    [
        pytest.param(
            "GET", "/v1/projects/rest-project/nothing", None, 404, "NOT_FOUND",
            "No REST route matches GET /v1/projects/rest-project/nothing.", id="unknown-path",
        ),
        pytest.param(
            "DELETE", "/v1/projects/rest-project/topics/orders:publish", None, 404, "NOT_FOUND",
            "No REST route matches DELETE /v1/projects/rest-project/topics/orders:publish.", id="wrong-verb",
        ),
        pytest.param(
            "GET", "/v1/projects/rest-project/topics?pageSize=x", None, 400, "INVALID_ARGUMENT",
            None, id="bad-query-value",
        ),
        pytest.param(
            "GET", "/v1/projects/rest-project/topics?color=red", None, 400, "INVALID_ARGUMENT",
            'Invalid JSON payload received. Unknown name "color": Cannot bind query parameter. '
            "Field 'color' could not be found in request message.", id="unknown-query-parameter",
        ),
        pytest.param(
            "PUT", "/v1/projects/rest-project/topics/orders", b"{not json", 400, "INVALID_ARGUMENT",
            None, id="malformed-json",
        ),
        pytest.param(
            "PUT", "/v1/projects/rest-project/topics/orders", {"colour": "red"}, 400, "INVALID_ARGUMENT",
            None, id="unknown-field",
        ),
        pytest.param(
            "POST", "/v1/projects/rest-project/topics/orders:publish", {"messages": [{"data": 5}]},
            400, "INVALID_ARGUMENT", None, id="data-not-a-string",
        ),
        pytest.param(
            "GET", "/v1/projects/rest-project/topics/orders", b'{"name": "x"}', 400, "INVALID_ARGUMENT",
            "Invalid JSON payload received. GetTopic takes no request body.", id="body-on-get",
        ),
        pytest.param(
            "PUT", "/v1/projects/rest-project/topics/ab", {}, 400, "INVALID_ARGUMENT", None,
            id="service-validation",
        ),
    ],
)  # fmt: skip
def test_refusals_in_googles_json_error_form(
    rest: Rest, method: str, path: str, body: Any, status: int, code: str, message: str | None
) -> None:
    answer_status, document = rest.request(method, path, body)
    assert answer_status == status
    assert set(document) == {"error"} and set(document["error"]) == {"code", "message", "status"}
    assert (document["error"]["code"], document["error"]["status"]) == (status, code)
    if message is not None:
        assert document["error"]["message"] == message
    else:
        assert document["error"]["message"]


def test_a_pull_answers_within_x_server_timeout(rest: Rest, monkeypatch: pytest.MonkeyPatch) -> None:
    # gcloud sends X-Server-Timeout; a Pull that waits for messages answers (empty) before it runs out.
    # Without the header the Pull would wait far longer than the test client's own 30 s socket timeout,
    # so an answer at all shows the header was taken: no clock is read here.
    monkeypatch.setattr(grpc_api, "PULL_WAIT_SECONDS", 3600.0)
    topic, subscription = f"{PROJECT}/topics/quiet", f"{PROJECT}/subscriptions/quiet-sub"
    rest.request("PUT", f"/v1/{topic}", {})
    rest.request("PUT", f"/v1/{subscription}", {"topic": topic})
    answer = rest.request("POST", f"/v1/{subscription}:pull", {"maxMessages": 1}, {"X-Server-Timeout": "1"})
    assert answer == (200, {})


def test_a_client_that_asks_before_sending_its_body_is_told_to_continue(server: LocalServer) -> None:
    # curl sends "Expect: 100-continue" before a large body and waits (a second) for the go-ahead.
    body = json.dumps({"labels": {"asked": "first"}}).encode()
    head = (
        f"PUT /v1/{PROJECT}/topics/asked HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        "Expect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection((server.host, server.port), timeout=10) as connection:
        connection.sendall(head)
        assert connection.recv(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
        connection.sendall(body)
        answer = b""
        while b"}\n}" not in answer:
            chunk = connection.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK") and b'"asked": "first"' in answer


def test_the_root_path_answers_ok_as_the_emulator_does(rest: Rest) -> None:
    assert rest.request("GET", "/") == (200, "Ok\n")


def test_schemas_over_rest(rest: Rest) -> None:
    # The schema ID goes in a query parameter, the schema in the body, the view as an enum name.
    definition = json.dumps({"type": "record", "name": "Order", "fields": [{"name": "id", "type": "int"}]})
    schema = f"{PROJECT}/schemas/orders-avro"
    status, created = rest.request(
        "POST", f"/v1/{PROJECT}/schemas?schemaId=orders-avro", {"type": "AVRO", "definition": definition}
    )
    assert status == 200 and (created["name"], created["definition"]) == (schema, definition)
    status, basic = rest.request("GET", f"/v1/{schema}?view=BASIC")
    assert status == 200 and "definition" not in basic
    assert rest.request("GET", f"/v1/{schema}?view=FULL")[1]["definition"] == definition

    def validate(message: bytes) -> tuple[int, Any]:
        body = {"name": schema, "message": base64.b64encode(message).decode(), "encoding": "JSON"}
        return rest.request("POST", f"/v1/{PROJECT}/schemas:validateMessage", body)

    assert validate(b'{"id": 5}') == (200, {})
    status, refused = validate(b'{"id": "five"}')
    assert (status, refused["error"]["status"]) == (400, "INVALID_ARGUMENT")

    topic = f"{PROJECT}/topics/typed"
    settings = {"schemaSettings": {"schema": schema, "encoding": "JSON"}}
    assert rest.request("PUT", f"/v1/{topic}", settings)[1]["schemaSettings"] == settings["schemaSettings"]
    good = {"messages": [{"data": base64.b64encode(b'{"id": 1}').decode()}]}
    assert rest.request("POST", f"/v1/{topic}:publish", good)[0] == 200
    bad = {"messages": [{"data": base64.b64encode(b'{"id": "one"}').decode()}]}
    assert rest.request("POST", f"/v1/{topic}:publish", bad)[0] == 400

    status, revisions = rest.request("GET", f"/v1/{schema}:listRevisions")
    assert status == 200 and [revision["revisionId"] for revision in revisions["schemas"]] == [
        created["revisionId"]
    ]


# ------------------------------------------------------------------- IAM, faults and logs apply too


def test_iam_enforcement_applies_to_rest_calls() -> None:
    tokens = {"t-admin": "user:admin@example.com", "t-nobody": "user:nobody@example.com"}
    policy = {"bindings": [{"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]}]}
    with LocalServer(in_memory=True, iam=IamConfig(tokens, policy)) as server:
        rest = Rest(server.address)
        topic = f"/v1/{PROJECT}/topics/secured"
        status, document = rest.request("PUT", topic, {})
        assert (status, document["error"]["status"]) == (401, "UNAUTHENTICATED")
        status, document = rest.request("PUT", topic, {}, {"Authorization": "Bearer t-nobody"})
        assert (status, document) == (
            403,
            error(403, "PERMISSION_DENIED", "User not authorized to perform this action."),
        )
        assert rest.request("PUT", topic, {}, {"Authorization": "Bearer t-admin"}) == (
            200,
            {"name": topic[4:]},
        )
        rest.close()


def test_fault_injection_and_request_logging_apply_to_rest_calls(
    server: LocalServer, rest: Rest, caplog: pytest.LogCaptureFixture, wait_for: Callable[..., bool]
) -> None:
    server.faults.set("GetTopic", "error=UNAVAILABLE:100%")
    with caplog.at_level(logging.DEBUG, logger="hedgepub.server.requests"):
        status, document = rest.request("GET", f"/v1/{PROJECT}/topics/anything")
        # The server logs the call when its handler ends, on its own thread, which may be just after
        # the answer reached the client.
        wait_for(lambda: any(record.name == "hedgepub.server.requests" for record in caplog.records))
    assert (status, document) == (
        503,
        error(503, "UNAVAILABLE", "UNAVAILABLE injected on GetTopic by hedgepub fault injection"),
    )
    assert server.faults.counts["GetTopic"].failed == 1
    [logged] = [record.getMessage() for record in caplog.records if record.name == "hedgepub.server.requests"]
    # The log names the HTTP client, not the gateway that made the gRPC call for it.
    assert re.fullmatch(r"GetTopic UNAVAILABLE [\d.]+ ms \(peer ipv4:127\.0\.0\.1:\d+ over REST\)", logged)


def test_a_server_without_rest_serves_grpc_on_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalServer(in_memory=True, rest=False) as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher = pubsub_v1.PublisherClient()
        assert publisher.create_topic(name=f"{PROJECT}/topics/plain").name == f"{PROJECT}/topics/plain"
        publisher.stop()


def test_a_client_keeping_its_connection_open_does_not_hold_the_server_up() -> None:
    # An idle keep-alive connection (a requests.Session, say) must not make stop(0) wait for its next
    # request: aiohttp would, given a shutdown timeout of 0.
    server = LocalServer(in_memory=True).start()
    with socket.create_connection((server.host, server.port), timeout=10) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200 OK")
        started = time.monotonic()
        server.stop(0)
        # The bound is the behaviour (stop(0) must not wait for the connection's next request, which
        # would never come): generous, as a loaded machine may take seconds to stop the server.
        assert time.monotonic() - started < 30
        assert connection.recv(65536) == b""  # and the server closed it
