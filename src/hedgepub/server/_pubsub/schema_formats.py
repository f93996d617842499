"""Schema formats: Avro and Protocol Buffer definitions compiled once by a real library, then checking
messages in either encoding.

Avro goes through ``fastavro`` (``parse_schema``; binary messages through ``schemaless_reader``, JSON
messages through its JSON reader). Protocol Buffer definitions are compiled by ``protoc`` from
``grpcio-tools`` into a ``FileDescriptorSet``, loaded into a ``google.protobuf`` descriptor pool of their
own (two schemas may both define ``message Event``), and messages are parsed by the generated class
(binary) or ``json_format`` (JSON). No format is parsed by hand here.

The JSON form of an Avro message must carry every field of the record (a default is not a licence to
leave it out, as in Avro's own Java decoder), and a binary message must hold exactly one value ("Too
much data to parse for schema."); a schema defines exactly one top-level type and imports nothing.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import fastavro
import fastavro.validation
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from google.pubsub_v1.types import schema as schema_types

from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.nesting import avro_has_choices, avro_is_recursive, check_avro_depth, load_json

__all__ = ["PROTOC_TIMEOUT_SECONDS", "SchemaMismatch", "Validator", "compile_schema"]

SchemaType = schema_types.Schema.Type
Encoding = schema_types.Encoding

#: Deepest nesting of arrays and objects in an Avro definition (JSON): a record nested in a record takes
#: three levels, so about 65 nested records; far more than real schemas use, and little enough that
#: fastavro's recursive parser and reader stay within the thread's stack.
MAX_DEFINITION_DEPTH = 200
#: Seconds protoc may take to compile one definition.
PROTOC_TIMEOUT_SECONDS = 30.0
_PROTO_FILE = "schema.proto"


class SchemaMismatch(ValueError):
    """A message that one schema revision does not accept; the text says what failed."""


class Validator:
    """A compiled definition that checks message data in JSON or BINARY encoding."""

    def validate(self, data: bytes, encoding: int) -> None:
        """Return if ``data`` matches; raise :class:`SchemaMismatch` naming what failed otherwise."""
        if encoding == Encoding.JSON:
            self._json(data)
        elif encoding == Encoding.BINARY:
            self._binary(data)
        else:
            raise invalid("No encoding provided.")

    def _json(self, data: bytes) -> None:
        raise NotImplementedError

    def _binary(self, data: bytes) -> None:
        raise NotImplementedError


class AvroValidator(Validator):
    """An Avro schema, parsed by fastavro."""

    def __init__(self, definition: str) -> None:
        try:
            raw = load_json(definition, "The schema definition", MAX_DEFINITION_DEPTH)
        except ValueError as error:
            raise invalid(f"Could not parse schema definition: it is not JSON ({error}).") from None
        except ServiceError as error:
            raise invalid(f"Could not parse schema definition: {error.message}") from None
        self.raw = raw
        #: A schema that refers to itself lets a message nest deeper than the schema: such messages are
        #: measured before fastavro's (recursive, C) reader sees them.
        self.recursive = avro_is_recursive(raw)
        #: Whether binary messages are walked first (:func:`check_avro_depth`): for depth, and for union
        #: and enum indexes, which fastavro takes negative (counting from the end) where Avro refuses them.
        self.walk = self.recursive or avro_has_choices(raw)
        try:
            self.schema = fastavro.parse_schema(raw)
            # The JSON reader fills a missing field from its default; the schema it reads with has none,
            # so that a JSON message must spell out every field (as Avro's Java decoder requires).
            self._json_schema = fastavro.parse_schema(_without_defaults(raw))
        except Exception as error:  # fastavro raises many types (SchemaParseException, UnknownType, ...)
            raise invalid(f"Could not parse schema definition: {type(error).__name__}: {error}") from None

    def _json(self, data: bytes) -> None:
        value = _load_message_json(data)
        # fastavro's JSON reader reads one value per line: give it the value on one line.
        text = io.StringIO(json.dumps(value))
        try:
            records = list(fastavro.json_reader(text, self._json_schema))
            fastavro.validation.validate(records[0], self.schema, raise_errors=True)
        except fastavro.validation.ValidationError as error:
            raise SchemaMismatch(
                f"JSON Avro message does not match: {'; '.join(map(str, error.errors))}"
            ) from None
        except Exception as error:  # the reader raises what the JSON trips over (ValueError, TypeError...)
            reason = f"{type(error).__name__}: {error}"
            raise SchemaMismatch(f"Could not parse JSON Avro message: {reason}") from None

    def _binary(self, data: bytes) -> None:
        if self.walk:
            try:
                check_avro_depth(self.raw, data)
            except ServiceError as error:
                raise SchemaMismatch(error.message) from None
        stream = io.BytesIO(data)
        try:
            fastavro.schemaless_reader(stream, self.schema)
        except Exception as error:  # EOFError, IndexError, UnicodeDecodeError, ... from truncated bytes
            raise SchemaMismatch(
                f"Could not parse binary Avro message: {type(error).__name__}: {error}".rstrip(": ")
            ) from None
        if stream.tell() != len(data):
            raise SchemaMismatch("Too much data to parse for schema.")


class ProtoValidator(Validator):
    """A Protocol Buffer schema: one top-level message type, from a compiled FileDescriptorSet."""

    def __init__(self, descriptor_set: bytes, root_message: str | None = None) -> None:
        files = descriptor_pb2.FileDescriptorSet()
        try:
            files.ParseFromString(descriptor_set)
        except DecodeError:
            raise invalid("The compiled schema is not a FileDescriptorSet.") from None
        pool = descriptor_pool.DescriptorPool()
        try:
            for file in files.file:
                pool.Add(file)
            if root_message is None:
                root_message = _single_root(files)
            descriptor = pool.FindMessageTypeByName(root_message)
        except (TypeError, KeyError, ValueError) as error:
            raise invalid(f"Invalid Protocol Buffer schema: {error}") from None
        self.message_class = message_factory.GetMessageClass(descriptor)

    @classmethod
    def from_definition(cls, definition: str) -> ProtoValidator:
        """Compile ``.proto`` text with protoc (blocking: run it off the event loop)."""
        return cls(compile_proto(definition))

    def _json(self, data: bytes) -> None:
        value = _load_message_json(data)
        # json_format takes any JSON container for a message (a list reads as no fields): ask for an object.
        if not isinstance(value, dict):
            raise SchemaMismatch(
                f"Could not parse JSON message: expected an object, got {type(value).__name__}."
            )
        try:
            json_format.ParseDict(value, self.message_class())
        except (json_format.ParseError, RecursionError) as error:
            raise SchemaMismatch(f"Could not parse JSON message: {error}") from None

    def _binary(self, data: bytes) -> None:
        message = self.message_class()
        try:
            message.ParseFromString(data)
        except DecodeError as error:
            raise SchemaMismatch(f"Could not parse binary message: {error}") from None
        if not message.IsInitialized():
            # Every message class has FindInitializationErrors; types-protobuf's Message does not declare it.
            missing = ", ".join(message.FindInitializationErrors())  # type: ignore[attr-defined]
            raise SchemaMismatch(f"Required fields are missing: {missing}.")


def _load_message_json(data: bytes) -> Any:
    """A message's JSON value, no deeper than MAX_JSON_DEPTH; SchemaMismatch when it is not that."""
    try:
        return load_json(data, "The message")
    except ValueError as error:
        raise SchemaMismatch(f"The message is not JSON: {error}") from None
    except ServiceError as error:
        raise SchemaMismatch(error.message) from None


def _single_root(files: Any) -> str:
    """The one top-level message type of a compiled definition (refusing imports and other types)."""
    file = files.file[-1]  # protoc lists the named file last, after anything it imports
    if file.dependency:
        raise invalid(
            "Invalid Protocol Buffer schema: imports are not supported; define everything in one message "
            f"(imports: {', '.join(file.dependency)})."
        )
    top_level = [message.name for message in file.message_type] + [enum.name for enum in file.enum_type]
    if len(file.message_type) != 1 or len(top_level) != 1:
        raise invalid(
            "Invalid Protocol Buffer schema: it must define exactly one top-level type, a message; "
            f"found {len(top_level)} ({', '.join(top_level) or 'none'})."
        )
    name = file.message_type[0].name
    return f"{file.package}.{name}" if file.package else name


def compile_proto(definition: str) -> bytes:
    """Compile ``.proto`` text to a serialized FileDescriptorSet with grpcio-tools' protoc.

    protoc runs in a child process: it prints its errors on the process's stderr (which a server must not
    take over) and a crash in it cannot take the server down. Its errors come back as INVALID_ARGUMENT,
    with their line and column.
    """
    with tempfile.TemporaryDirectory(prefix="hedgepub-schema-") as directory:
        source = Path(directory, _PROTO_FILE)
        source.write_text(definition, encoding="utf-8")
        output = Path(directory, "schema.pb")
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={directory}",
            f"--descriptor_set_out={output}",
            "--include_imports",
            _PROTO_FILE,
        ]
        try:
            finished = subprocess.run(
                command, cwd=directory, capture_output=True, text=True, timeout=PROTOC_TIMEOUT_SECONDS
            )
        except subprocess.TimeoutExpired:
            raise invalid("Could not parse schema definition: protoc took too long.") from None
        if finished.returncode != 0:
            # protoc names the file, sometimes by its full temporary path: show "line L:C: ..." only.
            text = finished.stderr.replace(f"{directory}{os.sep}", "")
            errors = [line.strip() for line in text.splitlines() if line.startswith(_PROTO_FILE)]
            reason = "; ".join(errors) or text.strip() or f"protoc exited with {finished.returncode}"
            raise invalid(f"Could not parse schema definition: {reason.replace(_PROTO_FILE + ':', 'line ')}")
        return output.read_bytes()


def _without_defaults(schema: Any) -> Any:
    """A copy of a raw Avro schema (JSON value) whose record fields carry no ``default``."""
    if isinstance(schema, list):
        return [_without_defaults(branch) for branch in schema]
    if not isinstance(schema, dict):
        return schema
    stripped = {key: _without_defaults(value) for key, value in schema.items() if key != "fields"}
    if isinstance(schema.get("fields"), list):
        stripped["fields"] = [
            {key: _without_defaults(value) for key, value in field.items() if key != "default"}
            if isinstance(field, dict)
            else field
            for field in schema["fields"]
        ]
    return stripped


def compile_schema(schema: Any) -> Validator:
    """Check a ``Schema`` (type, definition size, definition) and compile it; blocking for protobuf."""
    if schema.type_ == SchemaType.AVRO:
        if schema.HasField("compiled_proto_schema"):
            raise invalid("compiled_proto_schema may only be given with type PROTOCOL_BUFFER.")
        _check_definition_size(schema.definition)
        return AvroValidator(schema.definition)
    if schema.type_ == SchemaType.PROTOCOL_BUFFER:
        if schema.HasField("compiled_proto_schema"):
            compiled = schema.compiled_proto_schema
            if not compiled.root_message:
                raise invalid("compiled_proto_schema.root_message must be given.")
            return ProtoValidator(compiled.compiled_bytes, compiled.root_message)
        _check_definition_size(schema.definition)
        return ProtoValidator.from_definition(schema.definition)
    raise invalid("Invalid schema type: it must be AVRO or PROTOCOL_BUFFER.")


def _check_definition_size(definition: str) -> None:
    if not definition:
        raise invalid("Could not parse schema definition: the definition is empty.")
    size = len(definition.encode("utf-8"))
    if size > limits.MAX_SCHEMA_DEFINITION_BYTES:
        raise limits.too_large("schema_definition_size", size, limits.MAX_SCHEMA_DEFINITION_BYTES)
