"""A small synchronous admin client for Pub/Sub servers: topics, subscriptions, pull and ack.

The bench uses it to create its topics and the CLI toolbox uses it for everything but publishing. It
speaks the ``google.pubsub.v1`` gRPC protocol directly, with the raw protobuf classes of
``google-cloud-pubsub`` (no proto-plus wrappers on the wire), so every call has an explicit timeout and
every failure is one exception type: :class:`hedgepub.RpcError`. The endpoint is read by the publisher's
own parser (:func:`~._transport.grpc.resolve_endpoint`), so both take the same forms with the same rules.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub import RpcError, StatusCode
from hedgepub._transport.grpc import CHANNEL_OPTIONS, ChannelTarget, map_rpc_error, resolve_endpoint
from hedgepub._wire import EMULATOR_HOST_ENV

#: Environment variable naming the emulator's ``host:port``, as for every Pub/Sub client library.
EMULATOR_HOST_VARIABLE = EMULATOR_HOST_ENV
#: The project used when none is given and the environment names none.
DEFAULT_PROJECT = "local-project"

_Topic = pubsub_types.Topic.pb()
_Subscription = pubsub_types.Subscription.pb()
_PUBLISHER = "/google.pubsub.v1.Publisher/"
_SUBSCRIBER = "/google.pubsub.v1.Subscriber/"


def default_project(environ: Mapping[str, str] | None = None) -> str:
    """The project to use when none is given, looked for where Google's tools look.

    In order: ``PUBSUB_PROJECT_ID`` (the emulator's convention), ``GOOGLE_CLOUD_PROJECT`` (the official
    client libraries), ``CLOUDSDK_CORE_PROJECT`` and then the active gcloud configuration's ``core/project``
    (what ``gcloud`` uses), and only then :data:`DEFAULT_PROJECT`.
    """
    environ = os.environ if environ is None else environ
    for variable in ("PUBSUB_PROJECT_ID", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        if environ.get(variable):
            return environ[variable]
    return gcloud_project(environ) or DEFAULT_PROJECT


def gcloud_project(environ: Mapping[str, str] | None = None) -> str | None:
    """``core/project`` of the active gcloud configuration, read from its file (no ``gcloud`` process).

    The configuration directory is ``CLOUDSDK_CONFIG``, else ``~/.config/gcloud`` (``%APPDATA%\\gcloud`` on
    Windows); the active configuration is ``CLOUDSDK_ACTIVE_CONFIG_NAME``, else the one named in its
    ``active_config`` file, else ``default``. None when there is no such file or it sets no project.
    """
    environ = os.environ if environ is None else environ
    if environ.get("CLOUDSDK_CONFIG"):
        directory = Path(environ["CLOUDSDK_CONFIG"])
    elif os.name == "nt" and environ.get("APPDATA"):
        directory = Path(environ["APPDATA"]) / "gcloud"
    else:
        directory = Path.home() / ".config" / "gcloud"
    name = environ.get("CLOUDSDK_ACTIVE_CONFIG_NAME")
    try:
        if not name:
            active = directory / "active_config"
            name = active.read_text(encoding="utf-8").strip() if active.is_file() else "default"
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(directory / "configurations" / f"config_{name or 'default'}", encoding="utf-8")
        project = parser.get("core", "project", fallback="").strip()
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    return project or None


def resource_path(project: str, kind: str, name: str) -> str:
    """``projects/<project>/<kind>/<name>`` for a short ID; a full path of that kind is returned as is.

    ``kind`` is ``topics`` or ``subscriptions``. Raises ``ValueError`` for a path of another kind or a
    malformed path, naming what was expected.
    """
    if "/" not in name:
        return f"projects/{project}/{kind}/{name}"
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "projects" or parts[2] != kind or not parts[1] or not parts[3]:
        raise ValueError(f"{name!r} is neither a short ID nor a path like projects/<project>/{kind}/<id>")
    return name


class AdminClient:
    """Admin calls against the Pub/Sub server at ``endpoint``.

    ``endpoint`` takes the publisher's forms (``host:port``, ``http://host:port``, ``https://host[:port]``;
    ``None``: ``PUBSUB_EMULATOR_HOST``); a malformed one raises ``ValueError``. ``access_token``, when
    given, identifies the caller: as call credentials over TLS, as ``authorization: Bearer`` metadata on
    a plain-text channel (what a local server with IAM enforcement reads). As for the publisher, a bare
    ``host:port`` with a token means TLS, which trusts the system's root certificates, or only the PEM
    ``root_certificates`` given (a private CA, ``hedgepub serve --tls-cert``).

    Every method raises :class:`hedgepub.RpcError` with the server's status code on failure, and
    ``RpcError(UNAVAILABLE)`` when the server cannot be reached within the timeout.
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        timeout: float = 10.0,
        access_token: str | None = None,
        root_certificates: bytes | None = None,
    ) -> None:
        self.target: ChannelTarget = resolve_endpoint(endpoint, credentials=access_token)
        self.endpoint = endpoint or self.target.target
        self.timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] = ()
        if not self.target.secure:
            self._channel = grpc.insecure_channel(self.target.target, options=CHANNEL_OPTIONS)
            if access_token is not None:
                self._metadata = (("authorization", f"Bearer {access_token}"),)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            if access_token is not None:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(access_token)
                )
            self._channel = grpc.secure_channel(self.target.target, credentials, options=CHANNEL_OPTIONS)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the channel is connected; ``RpcError(UNAVAILABLE)`` if not within ``timeout``."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=self.timeout if timeout is None else timeout)
        except grpc.FutureTimeoutError:
            # Unsubscribe its watcher thread, which would die on the channel's close otherwise
            # ("ValueError: Cannot monitor channel state: Channel closed!").
            ready.cancel()
            raise RpcError(StatusCode.UNAVAILABLE, f"no Pub/Sub server answers at {self.endpoint}") from None

    def _call(self, method: str, request: Any, response_class: Any) -> Any:
        call = self._channel.unary_unary(
            method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_class.FromString,
        )
        try:
            return call(request, timeout=self.timeout, metadata=self._metadata, wait_for_ready=False)
        except grpc.RpcError as error:
            raise map_rpc_error(error) from error

    # topics
    def create_topic(self, topic: str, labels: dict[str, str] | None = None) -> Any:
        """Create ``topic`` (a full path); returns the ``Topic`` message."""
        return self._call(_PUBLISHER + "CreateTopic", _Topic(name=topic, labels=labels or {}), _Topic)

    def get_topic(self, topic: str) -> Any:
        """The ``Topic`` message of ``topic``."""
        request = pubsub_types.GetTopicRequest.pb()(topic=topic)
        return self._call(_PUBLISHER + "GetTopic", request, _Topic)

    def delete_topic(self, topic: str) -> None:
        """Delete ``topic``."""
        request = pubsub_types.DeleteTopicRequest.pb()(topic=topic)
        self._call(_PUBLISHER + "DeleteTopic", request, empty_pb2.Empty)

    def list_topics(self, project: str) -> Iterator[Any]:
        """Every ``Topic`` of ``project``, across pages."""
        yield from self._list_all(
            _PUBLISHER + "ListTopics",
            pubsub_types.ListTopicsRequest.pb(),
            pubsub_types.ListTopicsResponse.pb(),
            project,
            "topics",
        )

    # subscriptions
    def create_subscription(
        self, subscription: str, topic: str, *, ack_deadline_seconds: int = 10, push_endpoint: str = ""
    ) -> Any:
        """Create ``subscription`` on ``topic`` (full paths); returns the ``Subscription`` message.

        With ``push_endpoint`` (an http or https URL) it is a push subscription: the server POSTs each
        message there.
        """
        request = _Subscription(name=subscription, topic=topic, ack_deadline_seconds=ack_deadline_seconds)
        if push_endpoint:
            request.push_config.push_endpoint = push_endpoint
        return self._call(_SUBSCRIBER + "CreateSubscription", request, _Subscription)

    def get_subscription(self, subscription: str) -> Any:
        """The ``Subscription`` message of ``subscription``."""
        request = pubsub_types.GetSubscriptionRequest.pb()(subscription=subscription)
        return self._call(_SUBSCRIBER + "GetSubscription", request, _Subscription)

    def delete_subscription(self, subscription: str) -> None:
        """Delete ``subscription``."""
        request = pubsub_types.DeleteSubscriptionRequest.pb()(subscription=subscription)
        self._call(_SUBSCRIBER + "DeleteSubscription", request, empty_pb2.Empty)

    def list_subscriptions(self, project: str) -> Iterator[Any]:
        """Every ``Subscription`` of ``project``, across pages."""
        yield from self._list_all(
            _SUBSCRIBER + "ListSubscriptions",
            pubsub_types.ListSubscriptionsRequest.pb(),
            pubsub_types.ListSubscriptionsResponse.pb(),
            project,
            "subscriptions",
        )

    def _list_all(
        self, method: str, request_class: Any, response_class: Any, project: str, field: str
    ) -> Iterator[Any]:
        """Every item of the repeated ``field`` of a paged List RPC on ``project``, page after page."""
        token = ""
        while True:
            request = request_class(project=f"projects/{project}", page_size=1000, page_token=token)
            response = self._call(method, request, response_class)
            yield from getattr(response, field)
            token = response.next_page_token
            if not token:
                return

    # pull
    def pull(self, subscription: str, max_messages: int, *, wait: float) -> list[Any]:
        """Up to ``max_messages`` ``ReceivedMessage``s; waits at most ``wait`` seconds, then returns ``[]``.

        A Pull that finds nothing may be held open by the server, so running out of ``wait`` is the
        normal "no messages" answer rather than an error.
        """
        request = pubsub_types.PullRequest.pb()(subscription=subscription, max_messages=max_messages)
        call = self._channel.unary_unary(
            _SUBSCRIBER + "Pull",
            request_serializer=type(request).SerializeToString,
            response_deserializer=pubsub_types.PullResponse.pb().FromString,
        )
        try:
            return list(call(request, timeout=wait, metadata=self._metadata).received_messages)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return []
            raise map_rpc_error(error) from error

    def acknowledge(self, subscription: str, ack_ids: list[str]) -> None:
        """Acknowledge ``ack_ids`` on ``subscription``."""
        request = pubsub_types.AcknowledgeRequest.pb()(subscription=subscription, ack_ids=ack_ids)
        self._call(_SUBSCRIBER + "Acknowledge", request, empty_pb2.Empty)

    def modify_ack_deadline(self, subscription: str, ack_ids: list[str], seconds: int) -> None:
        """Change the lease of ``ack_ids`` to ``seconds`` from now; 0 hands them back for redelivery."""
        request = pubsub_types.ModifyAckDeadlineRequest.pb()(
            subscription=subscription, ack_ids=ack_ids, ack_deadline_seconds=seconds
        )
        self._call(_SUBSCRIBER + "ModifyAckDeadline", request, empty_pb2.Empty)
