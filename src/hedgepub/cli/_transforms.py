"""``hedgepub transforms test``: run message transforms on a file of messages, offline.

The same engine as the local server's (:mod:`hedgepub.server._pubsub.transforms`), so a UDF that passes
here behaves the same on a topic or subscription of ``hedgepub serve``; no server is needed.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import click

from hedgepub.cli._exit import EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_codes_help


@click.group()
def transforms() -> None:
    """Single message transforms (JavaScript UDFs, compression), tried offline."""


def _load_transforms(path: Path) -> list[Any]:
    """The MessageTransforms of a YAML or JSON file: a list, or ``{"messageTransforms": [...]}`` (the form
    gcloud's ``--message-transforms-file`` takes); camelCase or snake_case field names."""
    from google.protobuf import json_format
    from google.pubsub_v1.types import pubsub as pubsub_types

    text = path.read_text()
    try:
        document = json.loads(text)
    except ValueError:
        try:
            import yaml
        except ImportError:  # PyYAML is not a dependency of hedgepub
            raise click.BadParameter(
                "not JSON, and YAML needs PyYAML (pip install pyyaml)", param_hint="'--transforms-file'"
            ) from None
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise click.BadParameter(
                f"neither JSON nor YAML: {error}", param_hint="'--transforms-file'"
            ) from None
    if isinstance(document, dict):
        document = document.get("messageTransforms", document.get("message_transforms"))
    if not isinstance(document, list):
        raise click.BadParameter("expected a list of message transforms", param_hint="'--transforms-file'")
    transform_class = pubsub_types.MessageTransform.pb()
    try:
        return [json_format.ParseDict(item, transform_class()) for item in document]
    except json_format.ParseError as error:
        raise click.BadParameter(str(error), param_hint="'--transforms-file'") from None


def _message(line: str, number: int) -> Any:
    """One message of the messages file: ``{"data": "text"}`` or ``{"data_base64": "..."}``, with optional
    ``attributes``, ``ordering_key``, ``message_id`` and ``publish_time`` (RFC 3339)."""
    from google.pubsub_v1.types import pubsub as pubsub_types

    try:
        fields = json.loads(line)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        message = pubsub_types.PubsubMessage.pb()()
        if "data_base64" in fields:
            message.data = base64.b64decode(fields["data_base64"])
        else:
            message.data = str(fields.get("data", "")).encode()
        message.attributes.update({str(k): str(v) for k, v in (fields.get("attributes") or {}).items()})
        message.ordering_key = str(fields.get("ordering_key", ""))
        message.message_id = str(fields.get("message_id", number))
        if fields.get("publish_time"):
            message.publish_time.FromJsonString(fields["publish_time"])
    except (ValueError, TypeError) as error:
        raise click.BadParameter(f"line {number}: {error}", param_hint="'--messages'") from None
    return message


def _shown(message: Any) -> dict[str, Any]:
    data = bytes(message.data)
    try:
        shown: dict[str, Any] = {"data": data.decode("utf-8")}
    except UnicodeDecodeError:
        shown = {"data_base64": base64.b64encode(data).decode("ascii")}
    shown["attributes"] = dict(message.attributes)
    if message.ordering_key:
        shown["ordering_key"] = message.ordering_key
    return shown


@transforms.command(
    "test",
    epilog=exit_codes_help(
        (EXIT_OK, "every message was transformed or filtered"),
        (EXIT_FAILED, "a transform failed on a message, or the transforms are invalid"),
        (EXIT_USAGE, "bad usage or an unreadable file"),
    ),
)
@click.option(
    "--transforms-file",
    "transforms_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="YAML or JSON: a list of message transforms, as gcloud's --message-transforms-file takes.",
)
@click.option(
    "--messages",
    "messages_file",
    type=click.File("r"),
    required=True,
    help='JSON Lines, one message a line: {"data": "...", "attributes": {...}} ("data_base64" for bytes); '
    "'-' reads stdin.",
)
@click.option("--steps", is_flag=True, help="Show what each transform made of each message.")
def test_command(transforms_file: Path, messages_file: Any, steps: bool) -> None:
    """Run the transforms of TRANSFORMS_FILE on each message of MESSAGES; print one JSON line a message.

    Each line has the message's number, its "outcome" (transformed, filtered or failed) and the
    transformed message or the error.
    """
    from hedgepub.server._pubsub.limits import ServiceError
    from hedgepub.server._pubsub.transforms import Pipeline, check_transforms

    given = _load_transforms(transforms_file)
    try:
        check_transforms(given)
        pipeline = Pipeline(given)
    except ServiceError as error:
        click.echo(f"error: {error.code.name}: {error.message}", err=True)
        sys.exit(EXIT_FAILED)
    failed = 0
    for number, line in enumerate(messages_file, start=1):
        if not line.strip():
            continue
        trace = pipeline.trace(_message(line, number))
        out: dict[str, Any] = {"message": number}
        last = trace[-1] if trace else None
        if last is not None and last.error is not None:
            failed += 1
            out.update(outcome="failed", transform=last.index, error=last.error)
        elif last is not None and last.message is None:
            out.update(outcome="filtered", transform=last.index)
        else:
            out["outcome"] = "transformed"
            out.update(_shown(last.message) if last is not None else _shown(_message(line, number)))
        if steps:
            out["steps"] = [
                {
                    "transform": step.index,
                    **(_shown(step.message) if step.message is not None else {}),
                    **({"error": step.error} if step.error else {}),
                }
                for step in trace
            ]
        click.echo(json.dumps(out))
    sys.exit(EXIT_FAILED if failed else EXIT_OK)
