"""Schemas: Avro and Protocol Buffer definitions, their revisions, and checking messages against them.

Two layers, as the rest of the server:

- **Formats** (:func:`compile_schema`, :class:`Validator`): a definition is compiled once by a real
  library and then checks messages in either encoding. Avro goes through ``fastavro`` (``parse_schema``;
  binary messages through ``schemaless_reader``, JSON messages through its JSON reader). Protocol Buffer
  definitions are compiled by ``protoc`` from ``grpcio-tools`` into a ``FileDescriptorSet``, loaded into a
  ``google.protobuf`` descriptor pool of their own (two schemas may both define ``message Event``), and
  messages are parsed by the generated class (binary) or ``json_format`` (JSON). No format is parsed
  by hand here.
- **Resources** (:class:`SchemaRegistry`): ``projects/{project}/schemas/{schema}`` with revisions (an
  8-hex-digit ID and a create time each, at most 20), written through to the :class:`Store` as one
  record per revision under ``{name}@{revision_id}``, so they survive a restart.

The real service's behaviour followed here (its documentation, and where that is silent Google's own
emulator): GetSchema defaults to the FULL view, the List calls to BASIC (no definition); a schema defines
exactly one top-level type and imports nothing; a topic validates a message against its allowed
revisions newest first and names the first that matches in ``googclient_schemarevisionid``; a message
no revision accepts is refused with INVALID_ARGUMENT "Invalid data in message: Message failed schema
validation." followed by what the last revision tried said. The JSON form of an Avro message must carry
every field of the record (a default is not a licence to leave it out, as in Avro's own Java decoder),
and a binary message must hold exactly one value ("Too much data to parse for schema.").
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fastavro
import fastavro.validation
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from google.pubsub_v1.types import schema as schema_types

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub.limits import ServiceError, invalid

Schema: Any = schema_types.Schema.pb()
SchemaType = schema_types.Schema.Type
Encoding = schema_types.Encoding
SchemaView = schema_types.SchemaView

#: Seconds protoc may take to compile one definition.
PROTOC_TIMEOUT_SECONDS = 30.0
#: Compiled definitions kept in memory (keyed by type and text, so equal revisions share one).
_CACHE_SIZE = 256
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
            raw = json.loads(definition)
        except ValueError as error:
            raise invalid(f"Could not parse schema definition: it is not JSON ({error}).") from None
        try:
            self.schema = fastavro.parse_schema(raw)
            # The JSON reader fills a missing field from its default; the schema it reads with has none,
            # so that a JSON message must spell out every field (as Avro's Java decoder requires).
            self._json_schema = fastavro.parse_schema(_without_defaults(raw))
        except Exception as error:  # fastavro raises many types (SchemaParseException, UnknownType, ...)
            raise invalid(f"Could not parse schema definition: {type(error).__name__}: {error}") from None

    def _json(self, data: bytes) -> None:
        try:
            value = json.loads(data)
        except ValueError as error:
            raise SchemaMismatch(f"The message is not JSON: {error}") from None
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
        try:
            value = json.loads(data)
        except ValueError as error:
            raise SchemaMismatch(f"The message is not JSON: {error}") from None
        # json_format takes any JSON container for a message (a list reads as no fields): ask for an object.
        if not isinstance(value, dict):
            raise SchemaMismatch(
                f"Could not parse JSON message: expected an object, got {type(value).__name__}."
            )
        try:
            json_format.ParseDict(value, self.message_class())
        except json_format.ParseError as error:
            raise SchemaMismatch(f"Could not parse JSON message: {error}") from None

    def _binary(self, data: bytes) -> None:
        message = self.message_class()
        try:
            message.ParseFromString(data)
        except DecodeError as error:
            raise SchemaMismatch(f"Could not parse binary message: {error}") from None
        if not message.IsInitialized():
            missing = ", ".join(message.FindInitializationErrors())
            raise SchemaMismatch(f"Required fields are missing: {missing}.")


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


def check_schema_name(name: str) -> tuple[str, str]:
    """Split ``projects/p/schemas/s`` or ``projects/p/schemas/s@rev`` into (name, revision ID or '')."""
    base, _, revision = name.partition("@")
    limits.check_name(base, "schemas")
    return base, revision


def _schema_not_found(what: str = "Schema") -> ServiceError:
    return ServiceError(StatusCode.NOT_FOUND, f"{what} not found.")


def _encoding_name(encoding: int) -> str:
    return Encoding(encoding).name


class SchemaRegistry:
    """The project's schemas and their revisions, written through to a store.

    ``wall_clock_ns`` is the calendar time revision create times come from (the core's, so a test that
    moves the core's clock moves these too).
    """

    def __init__(self, store: Any, wall_clock_ns: Callable[[], int]) -> None:
        self._store = store
        self._wall_clock_ns = wall_clock_ns
        #: schema name -> its revisions, oldest first.
        self._revisions: dict[str, list[Any]] = {}
        #: project (``projects/p``) -> how many schemas it holds, for the per-project quota.
        self._per_project: Counter[str] = Counter()
        #: Schemas being created (their first revision is on its way to the store): they count already.
        self._creating: set[str] = set()
        self._compiled: OrderedDict[tuple[int, bytes], Validator] = OrderedDict()

    # ------------------------------------------------------------ lifecycle
    def load(self, stored: dict[str, Any]) -> None:
        """Take back the revisions a store holds (keys ``{name}@{revision_id}``)."""
        self._revisions = {}
        for revision in stored.values():
            self._revisions.setdefault(revision.name, []).append(revision)
        for revisions in self._revisions.values():
            revisions.sort(key=lambda revision: (_stamp(revision), revision.revision_id))
        self._per_project = Counter(_project(name) for name in self._revisions)

    def clear(self) -> None:
        """Forget every schema (the store is cleared by its owner)."""
        self._revisions.clear()
        self._per_project.clear()

    # ------------------------------------------------------------ compiling
    async def validator(self, schema: Any) -> Validator:
        """The compiled form of a schema (cached; protoc runs in a worker thread, off the event loop)."""
        key = (schema.type_, schema.definition.encode() + schema.compiled_proto_schema.SerializeToString())
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            return found
        if schema.type_ == SchemaType.PROTOCOL_BUFFER and not schema.HasField("compiled_proto_schema"):
            compiled = await asyncio.get_running_loop().run_in_executor(None, compile_schema, schema)
        else:
            compiled = compile_schema(schema)
        self._compiled[key] = compiled
        while len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    # ------------------------------------------------------------ lookups
    def _latest(self, name: str) -> list[Any]:
        revisions = self._revisions.get(name)
        if not revisions:
            raise _schema_not_found()
        return revisions

    def revision(self, name: str) -> Any:
        """The revision a name (``schema`` or ``schema@revision``) means: the latest if none is given."""
        base, revision_id = check_schema_name(name)
        revisions = self._latest(base)
        if not revision_id:
            return revisions[-1]
        for revision in revisions:
            if revision.revision_id == revision_id:
                return revision
        raise _schema_not_found("Schema revision")

    def get(self, name: str, view: int) -> Any:
        """GetSchema: FULL unless BASIC is asked for."""
        return _view(self.revision(name), view or SchemaView.FULL)

    def names(self, parent: str) -> list[str]:
        """ListSchemas: the sorted names of the project's schemas."""
        limits.check_project(parent)
        prefix = f"{parent}/schemas/"
        return sorted(name for name in self._revisions if name.startswith(prefix))

    def listed(self, names: Sequence[str], view: int) -> list[Any]:
        """The latest revisions of ``names`` in ``view`` (BASIC unless FULL is asked for)."""
        return [_view(self._revisions[name][-1], view or SchemaView.BASIC) for name in names]

    def revisions(self, name: str, view: int) -> list[Any]:
        """ListSchemaRevisions: every revision of a schema, oldest first, as Google's emulator lists them."""
        base, _ = check_schema_name(name)
        return [_view(revision, view or SchemaView.BASIC) for revision in self._latest(base)]

    # ------------------------------------------------------------ changes
    async def create(self, parent: str, schema_id: str, schema: Any) -> Any:
        """CreateSchema: a new schema with its first revision."""
        limits.check_project(parent)
        name = f"{parent}/schemas/{schema_id}"
        limits.check_name(name, "schemas")
        if name in self._revisions or name in self._creating:
            raise ServiceError(StatusCode.ALREADY_EXISTS, "Schema already exists.")
        await self.validator(schema)
        if name in self._revisions or name in self._creating:  # created concurrently while protoc ran
            raise ServiceError(StatusCode.ALREADY_EXISTS, "Schema already exists.")
        self._check_quota(parent)
        self._creating.add(name)
        try:
            return await self._add(name, schema, [])
        finally:
            self._creating.discard(name)

    def _check_quota(self, project: str) -> None:
        """RESOURCE_EXHAUSTED when ``project`` holds its quota of schemas (those being created count)."""
        held = self._per_project[project] + sum(_project(name) == project for name in self._creating)
        if held >= limits.MAX_SCHEMAS_PER_PROJECT:
            raise ServiceError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"The project {project} already has {held} schemas, the most a project may have. "
                "Delete a schema before creating another.",
            )

    async def commit(self, name: str, schema: Any) -> Any:
        """CommitSchema: a new revision of an existing schema, of the same type."""
        base, _ = check_schema_name(name)
        revisions = self._latest(base)
        if schema.type_ != revisions[-1].type_:
            raise invalid(
                f"The schema type cannot change: {name} is {SchemaType(revisions[-1].type_).name}, the "
                f"revision is {SchemaType(schema.type_).name}."
            )
        await self.validator(schema)
        return await self._add(base, schema, self._latest(base))

    async def rollback(self, name: str, revision_id: str) -> Any:
        """RollbackSchema: a new revision that copies an older one."""
        base, _ = check_schema_name(name)
        if not revision_id:
            raise invalid("revision_id must be given.")
        revisions = self._latest(base)
        for revision in revisions:
            if revision.revision_id == revision_id:
                return await self._add(base, revision, revisions)
        raise _schema_not_found("Revision")

    async def _add(self, name: str, source: Any, revisions: list[Any]) -> Any:
        if len(revisions) >= limits.MAX_SCHEMA_REVISIONS:
            raise ServiceError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"The schema {name} already has {len(revisions)} revisions, the most a schema may have. "
                "Delete a revision before committing another.",
            )
        revision = Schema()
        revision.name = name
        revision.type_ = source.type_
        revision.definition = source.definition
        if source.HasField("compiled_proto_schema"):
            revision.compiled_proto_schema.CopyFrom(source.compiled_proto_schema)
        taken = {existing.revision_id for existing in revisions}
        revision.revision_id = os.urandom(4).hex()
        while revision.revision_id in taken:
            revision.revision_id = os.urandom(4).hex()
        seconds, nanos = divmod(self._wall_clock_ns(), 1_000_000_000)
        # Strictly after the previous revision: revision ranges are ordered by create time.
        if revisions and (seconds, nanos) <= _stamp(revisions[-1]):
            seconds, nanos = divmod(revisions[-1].revision_create_time.ToNanoseconds() + 1000, 1_000_000_000)
        revision.revision_create_time.seconds = seconds
        revision.revision_create_time.nanos = nanos
        await self._store.put("schemas", f"{name}@{revision.revision_id}", revision)
        if name not in self._revisions:
            self._per_project[_project(name)] += 1
        self._revisions.setdefault(name, []).append(revision)
        return revision

    async def delete_revision(self, name: str, revision_id: str = "") -> Any:
        """DeleteSchemaRevision: the name carries the revision (or, deprecated, ``revision_id`` does)."""
        base, named = check_schema_name(name)
        revision_id = named or revision_id
        if not revision_id:
            raise _schema_not_found("Schema revision")
        revision = self.revision(f"{base}@{revision_id}")
        revisions = self._revisions[base]
        if len(revisions) == 1:
            raise invalid("Cannot delete last revision. Please use DeleteSchema.")
        await self._store.delete("schemas", f"{base}@{revision_id}")
        revisions.remove(revision)
        return revision

    async def delete(self, name: str) -> None:
        """DeleteSchema: every revision goes (topics naming it are the core's business)."""
        base, revision_id = check_schema_name(name)
        if revision_id:
            raise invalid(f"DeleteSchema takes a schema name without a revision (name={name}).")
        revisions = list(self._latest(base))
        for revision in revisions:
            await self._store.delete("schemas", f"{base}@{revision.revision_id}")
        if self._revisions.pop(base, None) is not None:
            self._per_project[_project(base)] -= 1

    # ------------------------------------------------------------ validation
    async def validate_schema(self, parent: str, schema: Any) -> None:
        """ValidateSchema: compile it, keep nothing."""
        limits.check_project(parent)
        await self.validator(schema)

    async def validate_message(self, request: Any) -> None:
        """ValidateMessage: against a stored schema (``name``, latest revision) or an ad hoc one."""
        limits.check_project(request.parent)
        if request.HasField("schema"):
            validator = await self.validator(request.schema)
        else:
            if not request.name:
                raise invalid("Invalid schema type: give a schema name or a schema.")
            validator = await self.validator(self.revision(request.name))
        if request.encoding not in (Encoding.JSON, Encoding.BINARY):
            raise invalid("No encoding provided.")
        try:
            validator.validate(request.message, request.encoding)
        except SchemaMismatch as error:
            raise invalid(f"Message failed schema validation: {error}") from None

    def check_settings(self, settings: Any) -> None:
        """A topic's ``schema_settings``: an existing schema, an encoding, an ordered revision range."""
        base, revision_id = check_schema_name(settings.schema)
        if revision_id:
            raise invalid(f"schema_settings.schema must name a schema, not a revision ({settings.schema}).")
        revisions = self._revisions.get(base)
        if not revisions:
            raise ServiceError(StatusCode.NOT_FOUND, f"Schema could not be found (schema={base}).")
        if settings.encoding not in (Encoding.JSON, Encoding.BINARY):
            raise invalid("Invalid schema encoding provided: it must be JSON or BINARY.")
        by_id = {revision.revision_id: revision for revision in revisions}
        first = last = None
        if settings.first_revision_id:
            first = by_id.get(settings.first_revision_id)
            if first is None:
                raise ServiceError(StatusCode.NOT_FOUND, "First revision could not be found.")
        if settings.last_revision_id:
            last = by_id.get(settings.last_revision_id)
            if last is None:
                raise ServiceError(StatusCode.NOT_FOUND, "Last revision could not be found.")
        if first is not None and last is not None and _stamp(first) > _stamp(last):
            raise invalid("First revision creation time is after last revision creation time.")

    async def stamp_messages(self, topic: str, settings: Any, messages: Sequence[Any]) -> None:
        """Publish to a topic with a schema: check every message, then add the ``googclient_`` attributes.

        Each message is tried against the allowed revisions newest first; the first that accepts it is
        named in ``googclient_schemarevisionid``. Nothing is changed unless every message is accepted.
        """
        if settings.schema == limits.DELETED_SCHEMA:
            raise ServiceError(StatusCode.NOT_FOUND, "Schema associated with topic deleted.")
        allowed = list(reversed(self._allowed(settings)))
        if not allowed:
            raise ServiceError(StatusCode.NOT_FOUND, f"Schema could not be found (schema={settings.schema}).")
        validators = [(revision, await self.validator(revision)) for revision in allowed]
        encoding = settings.encoding
        matched: list[str] = []
        for index, message in enumerate(messages):
            failure = ""
            for revision, validator in validators:
                try:
                    validator.validate(message.data, encoding)
                except SchemaMismatch as error:
                    failure = f"revision_id={revision.revision_id} failed with status: {error}"
                    continue
                matched.append(revision.revision_id)
                break
            else:
                raise invalid(
                    f"Invalid data in message: Message failed schema validation. Message {index} of the "
                    f"request ({_encoding_name(encoding)} encoding) could not be validated with any schema "
                    f"revision for schema: {settings.schema}, last checked revision: {failure}"
                )
        encoding_name = _encoding_name(encoding)
        for message, revision_id in zip(messages, matched, strict=True):
            attributes = message.attributes
            attributes["googclient_schemaname"] = settings.schema
            attributes["googclient_schemaencoding"] = encoding_name
            attributes["googclient_schemarevisionid"] = revision_id

    def _allowed(self, settings: Any) -> list[Any]:
        """The revisions a topic accepts, oldest first (a bound whose revision is gone no longer bounds)."""
        revisions = self._revisions.get(settings.schema, [])
        by_id = {revision.revision_id: revision for revision in revisions}
        low = by_id.get(settings.first_revision_id)
        high = by_id.get(settings.last_revision_id)
        return [
            revision
            for revision in revisions
            if (low is None or _stamp(revision) >= _stamp(low))
            and (high is None or _stamp(revision) <= _stamp(high))
        ]

    def __repr__(self) -> str:
        count = sum(len(revisions) for revisions in self._revisions.values())
        return f"SchemaRegistry({len(self._revisions)} schemas, {count} revisions)"


def _project(schema_name: str) -> str:
    """``projects/p`` of ``projects/p/schemas/s``."""
    return schema_name.partition("/schemas/")[0]


def _stamp(revision: Any) -> tuple[int, int]:
    stamp = revision.revision_create_time
    return (stamp.seconds, stamp.nanos)


def _view(revision: Any, view: int) -> Any:
    """A revision as ``view`` shows it: BASIC (a copy) leaves out the definition."""
    if view == SchemaView.FULL:
        return revision
    shown = Schema()
    shown.CopyFrom(revision)
    shown.ClearField("definition")
    shown.ClearField("compiled_proto_schema")
    return shown
