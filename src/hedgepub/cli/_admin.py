"""The Pub/Sub toolbox: ``topics``, ``subscriptions``, ``publish`` and ``pull`` against an emulator.

Every command talks to the server named by ``--endpoint`` (the publisher's forms and rules, from the one
parser :func:`hedgepub._transport.grpc.parse_endpoint`: ``host:port``, ``http://host:port``,
``https://host[:port]``) or, without it, ``PUBSUB_EMULATOR_HOST`` (``host:port``, plain text), in the
project named by ``--project`` (default: ``PUBSUB_PROJECT_ID``, then ``GOOGLE_CLOUD_PROJECT``,
then gcloud's ``CLOUDSDK_CORE_PROJECT`` or active configuration, as Google's tools do, and only then
``local-project``). Topics and subscriptions are given as short IDs or as full paths
(``projects/P/topics/T``). An access token (``--access-token``, ``HEDGEPUB_ACCESS_TOKEN``, or the file
forms ``--access-token-file`` / ``HEDGEPUB_ACCESS_TOKEN_FILE``, which keep it out of shell history) is sent
with every request, for a server with IAM enforcement.

Exit codes (:mod:`hedgepub.cli._exit`; each command's ``--help`` lists the ones it can exit with):

====  ==================================================================
0     done
1     the server refused the request (another status code), a publish failed, or Ctrl-C
2     bad usage: unknown option, malformed value, no endpoint given, unreadable data file
3     no server answers at the endpoint
4     the topic or subscription does not exist (NOT_FOUND)
5     the topic or subscription already exists (ALREADY_EXISTS)
====  ==================================================================
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from hedgepub import PublishError, RetrySettings, StatusCode
from hedgepub._transport.grpc import resolve_endpoint
from hedgepub.admin import EMULATOR_HOST_VARIABLE, AdminClient, default_project, resource_path
from hedgepub.cli._exit import (
    EXIT_ALREADY_EXISTS,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    exit_codes_help,
)

__all__ = [
    "EXIT_ALREADY_EXISTS",
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_UNREACHABLE",
]

_EXIT_BY_CODE = {
    StatusCode.UNAVAILABLE: EXIT_UNREACHABLE,
    StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    StatusCode.ALREADY_EXISTS: EXIT_ALREADY_EXISTS,
}

# What each toolbox command's --help says about its exit codes (every code it can exit with, and no other).
_USAGE = (EXIT_USAGE, "bad usage")
_UNREACHABLE = (EXIT_UNREACHABLE, "no server at the endpoint")
_REFUSED = (EXIT_FAILED, "refused by the server, or Ctrl-C")
LIST_EXIT_CODES = exit_codes_help((EXIT_OK, "done"), _REFUSED, _USAGE, _UNREACHABLE)
TOPIC_CREATE_EXIT_CODES = exit_codes_help(
    (EXIT_OK, "done"), _REFUSED, _USAGE, _UNREACHABLE, (EXIT_ALREADY_EXISTS, "already exists")
)
SUBSCRIPTION_CREATE_EXIT_CODES = exit_codes_help(
    (EXIT_OK, "done"),
    _REFUSED,
    _USAGE,
    _UNREACHABLE,
    (EXIT_NOT_FOUND, "the topic does not exist"),
    (EXIT_ALREADY_EXISTS, "already exists"),
)
DELETE_EXIT_CODES = exit_codes_help(
    (EXIT_OK, "done"), _REFUSED, _USAGE, _UNREACHABLE, (EXIT_NOT_FOUND, "not found")
)
PUBLISH_EXIT_CODES = exit_codes_help(
    (EXIT_OK, "every message published"),
    (EXIT_FAILED, "a publish failed, the server refused, or Ctrl-C"),
    (EXIT_USAGE, "bad usage or unreadable data file"),
    _UNREACHABLE,
    (EXIT_NOT_FOUND, "topic not found"),
)
PULL_EXIT_CODES = exit_codes_help(
    (EXIT_OK, "done, also when no message came"),
    (EXIT_FAILED, "refused by the server, the output closed, or Ctrl-C"),
    _USAGE,
    _UNREACHABLE,
    (EXIT_NOT_FOUND, "subscription not found"),
)

_Command = TypeVar("_Command", bound=Callable[..., Any])


#: Environment variables of the access token and of a file holding it.
TOKEN_VARIABLE = "HEDGEPUB_ACCESS_TOKEN"
TOKEN_FILE_VARIABLE = "HEDGEPUB_ACCESS_TOKEN_FILE"
#: Environment variable of the PEM file of root certificates to trust over TLS.
ROOT_CERTIFICATES_VARIABLE = "HEDGEPUB_ROOT_CERTIFICATES"


class _Target:
    """Where a command sends its requests: endpoint, project, per-call timeout and access token."""

    def __init__(
        self,
        endpoint: str | None,
        project: str,
        timeout: float,
        access_token: str | None = None,
        access_token_file: Path | None = None,
        root_certificates: Path | None = None,
    ) -> None:
        if not endpoint and not os.environ.get(EMULATOR_HOST_VARIABLE):
            raise click.UsageError(
                f"no Pub/Sub server given: pass --endpoint HOST:PORT or set {EMULATOR_HOST_VARIABLE}"
            )
        self.token = _access_token(access_token, access_token_file)
        self.root_certificates = _read_root_certificates(root_certificates)
        try:
            self.channel = resolve_endpoint(endpoint, credentials=self.token)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="'--endpoint'") from None
        #: the endpoint given with --endpoint (None: PUBSUB_EMULATOR_HOST), and what messages call it
        self.explicit_endpoint = endpoint or None
        self.endpoint = endpoint or self.channel.target
        self.project = project
        self.timeout = timeout

    def path(self, kind: str, name: str) -> str:
        """The full path of a topic or subscription given as a short ID or a path."""
        try:
            return resource_path(self.project, kind, name)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None

    def admin(self) -> AdminClient:
        """An admin client for this target (close it, or use it in a ``with``)."""
        return AdminClient(
            self.explicit_endpoint,
            timeout=self.timeout,
            access_token=self.token,
            root_certificates=self.root_certificates,
        )

    def unreachable_hint(self) -> str:
        """Why a bare HOST:PORT with a token may not reach a plain-text server."""
        bare = "://" not in self.endpoint and self.channel.secure and self.token is not None
        return (
            " (with a token, a bare HOST:PORT means TLS; write http://HOST:PORT for a plain-text server)"
            if bare
            else ""
        )


def _access_token(token: str | None, token_file: Path | None) -> str | None:
    """The token given directly or read from a file (surrounding white space dropped); None if neither."""
    if token is not None and token_file is not None:
        raise click.UsageError("give --access-token or --access-token-file (or their variables), not both")
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            message = f"cannot read {token_file}: {reason}"
            raise click.BadParameter(message, param_hint="'--access-token-file'") from None
    if token is None:
        return None
    token = token.strip()
    if not token or any(character.isspace() for character in token):
        where = "--access-token-file" if token_file is not None else "--access-token"
        raise click.BadParameter("an access token is one word, without spaces", param_hint=f"'{where}'")
    return token


def _read_root_certificates(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as error:
        message = f"cannot read {path}: {error.strerror}"
        raise click.BadParameter(message, param_hint="'--root-certificates'") from None


def _connection_options(command: _Command) -> _Command:
    """Add --endpoint, --project, --timeout and the token options to ``command``, as one ``target``."""

    options = [
        click.option(
            "--endpoint",
            metavar="ENDPOINT",
            help=f"The Pub/Sub server: HOST:PORT, http://HOST:PORT (plain text) or https://HOST[:PORT] "
            f"(TLS). [default: {EMULATOR_HOST_VARIABLE}, plain text]",
        ),
        click.option(
            "--project",
            default=default_project,
            show_default="PUBSUB_PROJECT_ID, GOOGLE_CLOUD_PROJECT, gcloud's project, else local-project",
            help="Project of short topic and subscription IDs.",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=10.0,
            show_default=True,
            help="Seconds each request may take.",
        ),
        click.option(
            "--access-token",
            envvar=TOKEN_VARIABLE,
            show_envvar=True,
            metavar="TOKEN",
            help="OAuth access token sent with every request (a server with --iam enforce needs one).",
        ),
        click.option(
            "--access-token-file",
            envvar=TOKEN_FILE_VARIABLE,
            show_envvar=True,
            type=click.Path(dir_okay=False, path_type=Path),
            help="Read the access token from this file (keeps it out of shell history).",
        ),
        click.option(
            "--root-certificates",
            envvar=ROOT_CERTIFICATES_VARIABLE,
            show_envvar=True,
            type=click.Path(dir_okay=False, path_type=Path),
            help="PEM file of the certificates to trust over TLS instead of the system's (a private CA, "
            "or `hedgepub serve --tls-cert`).",
        ),
    ]

    @functools.wraps(command)
    def with_target(
        *args: Any,
        endpoint: str | None,
        project: str,
        timeout: float,
        access_token: str | None,
        access_token_file: Path | None,
        root_certificates: Path | None,
        **kwargs: Any,
    ) -> Any:
        target = _Target(endpoint, project, timeout, access_token, access_token_file, root_certificates)
        return command(*args, target=target, **kwargs)

    wrapped: Any = with_target
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped


@contextlib.contextmanager
def _errors_to_exit_codes(target: _Target, what: str = "", exists: str = "") -> Iterator[None]:
    """Turn a failed request into a one-line message on stderr and the documented exit code.

    ``what`` names the resource a NOT_FOUND is about, ``exists`` the one an ALREADY_EXISTS is about
    (``what`` when not given)."""
    try:
        yield
    except PublishError as error:
        code = error.code
        if code is StatusCode.UNAVAILABLE:
            message = (
                f"cannot reach a Pub/Sub server at {target.endpoint} ({error}){target.unreachable_hint()}"
            )
        elif code is StatusCode.NOT_FOUND:
            message = f"{what or 'resource'} not found: {error}"
        elif code is StatusCode.ALREADY_EXISTS:
            message = f"{exists or what or 'resource'} already exists: {error}"
        else:
            message = str(error)
        click.echo(f"error: {message}", err=True)
        # A code of None (no status) is not a key: EXIT_FAILED.
        raise click.exceptions.Exit(_EXIT_BY_CODE.get(code, EXIT_FAILED)) from None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- topics
@click.group()
def topics() -> None:
    """Create, list and delete topics."""


@topics.command("create", epilog=TOPIC_CREATE_EXIT_CODES)
@click.argument("names", nargs=-1, required=True, metavar="TOPIC...")
@_connection_options
def topics_create(names: tuple[str, ...], target: _Target) -> None:
    """Create each TOPIC (short ID or full path) and print its path."""
    with target.admin() as admin:
        for name in names:
            path = target.path("topics", name)
            with _errors_to_exit_codes(target, f"topic {path}"):
                click.echo(admin.create_topic(path).name)


@topics.command("list", epilog=LIST_EXIT_CODES)
@_connection_options
def topics_list(target: _Target) -> None:
    """Print the path of every topic of the project, one a line."""
    with target.admin() as admin, _errors_to_exit_codes(target, f"project {target.project}"):
        for topic in admin.list_topics(target.project):
            click.echo(topic.name)


@topics.command("delete", epilog=DELETE_EXIT_CODES)
@click.argument("names", nargs=-1, required=True, metavar="TOPIC...")
@_connection_options
def topics_delete(names: tuple[str, ...], target: _Target) -> None:
    """Delete each TOPIC (short ID or full path)."""
    _delete_each(target, "topics", names)


# --------------------------------------------------------------------------------------------- subscriptions
@click.group()
def subscriptions() -> None:
    """Create, list and delete subscriptions."""


@subscriptions.command("create", epilog=SUBSCRIPTION_CREATE_EXIT_CODES)
@click.argument("name", metavar="SUBSCRIPTION")
@click.option("--topic", required=True, help="The topic to subscribe to (short ID or full path).")
@click.option(
    "--ack-deadline",
    type=click.IntRange(10, 600),
    default=10,
    show_default=True,
    help="Seconds a pulled message stays leased before it is delivered again.",
)
@click.option(
    "--push-endpoint",
    default="",
    metavar="URL",
    help="Make it a push subscription: the server POSTs each message to this http(s) URL.",
)
@_connection_options
def subscriptions_create(
    name: str, topic: str, ack_deadline: int, push_endpoint: str, target: _Target
) -> None:
    """Create SUBSCRIPTION on --topic and print its path."""
    path = target.path("subscriptions", name)
    topic_path = target.path("topics", topic)
    with (
        target.admin() as admin,
        _errors_to_exit_codes(target, f"topic {topic_path}", exists=f"subscription {path}"),
    ):
        created = admin.create_subscription(
            path, topic_path, ack_deadline_seconds=ack_deadline, push_endpoint=push_endpoint
        )
        click.echo(created.name)


@subscriptions.command("list", epilog=LIST_EXIT_CODES)
@_connection_options
def subscriptions_list(target: _Target) -> None:
    """Print every subscription of the project and its topic, one a line."""
    with target.admin() as admin, _errors_to_exit_codes(target, f"project {target.project}"):
        for subscription in admin.list_subscriptions(target.project):
            click.echo(f"{subscription.name}\t{subscription.topic}")


@subscriptions.command("delete", epilog=DELETE_EXIT_CODES)
@click.argument("names", nargs=-1, required=True, metavar="SUBSCRIPTION...")
@_connection_options
def subscriptions_delete(names: tuple[str, ...], target: _Target) -> None:
    """Delete each SUBSCRIPTION (short ID or full path)."""
    _delete_each(target, "subscriptions", names)


def _delete_each(target: _Target, collection: str, names: tuple[str, ...]) -> None:
    """Delete each name of ``collection`` ("topics" or "subscriptions") in turn, printing each path."""
    with target.admin() as admin:
        delete = admin.delete_topic if collection == "topics" else admin.delete_subscription
        for name in names:
            path = target.path(collection, name)
            with _errors_to_exit_codes(target, f"{collection[:-1]} {path}"):
                delete(path)
            click.echo(f"deleted {path}")


# ---------------------------------------------------------------------------------------------------- publish
def _parse_attributes(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    attributes: dict[str, str] = {}
    for value in values:
        key, separator, text = value.partition("=")
        if not separator or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE")
        attributes[key] = text
    return attributes


def _read_data(data: str | None, data_file: str | None) -> bytes:
    """The message data: DATA as UTF-8, or the bytes of --data-file or standard input (``-``)."""
    if data is not None and data_file is not None:
        raise click.UsageError("give DATA or --data-file, not both")
    if data is None and data_file is None:
        raise click.UsageError("give DATA, '-' to read standard input, or --data-file PATH")
    if data is not None and data != "-":
        return data.encode("utf-8")
    source = data_file if data_file is not None else "-"
    if source == "-":
        return click.get_binary_stream("stdin").read()
    try:
        return Path(source).read_bytes()
    except OSError as error:
        raise click.BadParameter(
            f"cannot read {source}: {error.strerror}", param_hint="'--data-file'"
        ) from None


@click.command(epilog=PUBLISH_EXIT_CODES, short_help="Publish a message to a topic.")
@click.argument("topic")
@click.argument("data", required=False)
@click.option(
    "--data-file",
    metavar="PATH",
    help="Publish the bytes of this file as they are ('-': standard input) instead of DATA.",
)
@click.option(
    "--attr",
    "attributes",
    multiple=True,
    callback=_parse_attributes,
    metavar="KEY=VALUE",
    help="A message attribute; repeat for more.",
)
@click.option(
    "--count", type=click.IntRange(min=1), default=1, show_default=True, help="Publish DATA this many times."
)
@_connection_options
def publish(
    topic: str,
    data: str | None,
    data_file: str | None,
    attributes: dict[str, str],
    count: int,
    target: _Target,
) -> None:
    """Publish DATA to TOPIC and print each message ID.

    DATA is text, sent as UTF-8; '-' reads the data from standard input, and --data-file PATH from a
    file, as bytes (any size up to Pub/Sub's 10 MB, binary too): `hedgepub publish orders - < order.json`.
    Publishes through hedgepub's PublisherClient, retrying transient errors for at most --timeout
    seconds in all.
    """
    from hedgepub import PublisherClient  # the publisher is only needed here

    path = target.path("topics", topic)
    payload = _read_data(data, data_file)  # before any request: a usage error costs no round trip
    if not payload and not attributes:
        # Pub/Sub refuses a message with neither (INVALID_ARGUMENT): say so without sending it
        raise click.UsageError("the message is empty: give data (standard input was empty?) or an --attr")
    # GetTopic first: an absent server or topic is then reported at once instead of after retries. A
    # caller who may publish but not view the topic (roles/pubsub.publisher alone) goes on to publish.
    with target.admin() as admin, _errors_to_exit_codes(target, f"topic {path}"):
        try:
            admin.get_topic(path)
        except PublishError as error:
            if error.code is not StatusCode.PERMISSION_DENIED:
                raise
    retry = RetrySettings(initial_rpc_timeout=min(5.0, target.timeout), total_timeout=target.timeout)
    failures = 0
    credentials: Any = None
    if target.token is not None:
        import google.oauth2.credentials

        credentials = google.oauth2.credentials.Credentials(target.token)
    elif target.channel.secure:
        import google.auth.credentials

        # as for the other commands: no token, no credentials (not Application Default Credentials)
        credentials = google.auth.credentials.AnonymousCredentials()
    publisher = PublisherClient(
        retry_settings=retry,
        endpoint=target.explicit_endpoint,
        credentials=credentials,
        root_certificates=target.root_certificates,
    )
    with publisher as client:
        futures = [client.publish(path, payload, **attributes) for _ in range(count)]
        for future in futures:
            try:
                click.echo(future.result())
            except PublishError as error:
                failures += 1
                last_error = error
            except concurrent.futures.CancelledError:
                failures += 1
                last_error = PublishError("publish cancelled")
    if failures:
        with _errors_to_exit_codes(target, f"topic {path}"):
            click.echo(f"{failures} of {count} publishes failed", err=True)
            raise last_error


# ------------------------------------------------------------------------------------------------------- pull
def _describe(received: Any, as_json: bool) -> str:
    message = received.message
    data = message.data.decode("utf-8", errors="backslashreplace")
    if as_json:
        return json.dumps(
            {
                "message_id": message.message_id,
                "data": data,
                "attributes": dict(message.attributes),
                "ordering_key": message.ordering_key,
                "publish_time": message.publish_time.ToJsonString(),
                "delivery_attempt": received.delivery_attempt,
            }
        )
    attributes = " ".join(f"{key}={value}" for key, value in sorted(message.attributes.items()))
    # the data's own line end (text piped in usually has one) would put the attributes on a line of their own
    shown = data[:-2] if data.endswith("\r\n") else data[:-1] if data.endswith("\n") else data
    return f"{message.message_id}\t{shown}" + (f"\t{attributes}" if attributes else "")


@click.command(epilog=PULL_EXIT_CODES, short_help="Pull (and ack) messages from a subscription.")
@click.argument("subscription")
@click.option(
    "--max",
    "max_messages",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help="Most messages to pull.",
)
@click.option("--ack", is_flag=True, help="Acknowledge the pulled messages, so they are not delivered again.")
@click.option(
    "--wait",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds to wait for the first message.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per message.")
@_connection_options
def pull(
    subscription: str,
    max_messages: int,
    ack: bool,
    wait: float,
    as_json: bool,
    target: _Target,
) -> None:
    """Pull up to --max messages from SUBSCRIPTION and print them: ID, data and attributes, one a line.

    Without --ack the messages are delivered again once their ack deadline passes. Each message is printed
    as soon as it arrives; if pulling or printing fails (or Ctrl-C), the messages not yet printed are
    handed back at once (ModifyAckDeadline 0) and, with --ack, those printed are acknowledged.
    """
    path = target.path("subscriptions", subscription)
    delivered: list[Any] = []
    with target.admin() as admin, _errors_to_exit_codes(target, f"subscription {path}"):
        admin.get_subscription(path)
        undelivered: list[Any] = []
        try:
            batch = admin.pull(path, max_messages, wait=wait)
            # a Pull may answer with only part of what is there; ask again while it keeps answering
            while batch:
                undelivered = list(batch)
                while undelivered:
                    click.echo(_describe(undelivered[0], as_json))
                    delivered.append(undelivered.pop(0))
                if len(delivered) >= max_messages:
                    break
                batch = admin.pull(path, max_messages - len(delivered), wait=min(wait, 0.2))
        except BaseException as error:
            _settle_after_failure(admin, path, undelivered, delivered if ack else [])
            if isinstance(error, BrokenPipeError):
                _quiet_broken_stdout()
                click.echo(
                    f"error: the output closed after {len(delivered)} messages; "
                    f"{len(undelivered)} not printed were handed back for redelivery",
                    err=True,
                )
                raise click.exceptions.Exit(EXIT_FAILED) from None
            raise
        if ack and delivered:
            admin.acknowledge(path, [message.ack_id for message in delivered])
    if not delivered:
        click.echo("no messages", err=True)


def _settle_after_failure(admin: AdminClient, path: str, undelivered: list[Any], to_ack: list[Any]) -> None:
    """Hand back what the user never saw, acknowledge what they did (with --ack); best effort."""
    with contextlib.suppress(PublishError):
        if undelivered:
            admin.modify_ack_deadline(path, [message.ack_id for message in undelivered], 0)
    with contextlib.suppress(PublishError):
        if to_ack:
            admin.acknowledge(path, [message.ack_id for message in to_ack])


def _quiet_broken_stdout() -> None:
    """Point stdout at /dev/null, so that Python's exit does not report the closed pipe once more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
