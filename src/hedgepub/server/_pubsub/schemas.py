"""Schemas as resources: ``projects/{project}/schemas/{schema}`` with revisions (an 8-hex-digit ID and a
create time each, at most 20), written through to the :class:`Store` as one record per revision under
``{name}@{revision_id}``, so they survive a restart; and the checking of published messages against a
topic's schema settings. The formats themselves (compiling a definition, checking a message) are
:mod:`.schema_formats`.

The real service's behaviour followed here (its documentation, and where that is silent Google's own
emulator): GetSchema defaults to the FULL view, the List calls to BASIC (no definition); a topic
validates a message against its allowed revisions newest first and names the first that matches in
``googclient_schemarevisionid``; a message no revision accepts is refused with INVALID_ARGUMENT "Invalid
data in message: Message failed schema validation." followed by what the last revision tried said.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from google.pubsub_v1.types import schema as schema_types

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.schema_formats import SchemaMismatch, Validator, compile_schema

Schema: Any = schema_types.Schema.pb()
SchemaType = schema_types.Schema.Type
Encoding = schema_types.Encoding
SchemaView = schema_types.SchemaView

#: Validation work (message bytes, plus 256 a message, times the revisions to try) above which a Publish or
#: ValidateMessage is checked in a worker thread rather than on the event loop: about a millisecond of
#: the costliest kind (Avro JSON).
OFF_LOOP_BYTES = 64 * 1024
#: Compiled definitions kept in memory (keyed by type and text, so equal revisions share one).
_CACHE_SIZE = 256


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
            if len(request.message) > OFF_LOOP_BYTES:
                await asyncio.to_thread(validator.validate, request.message, request.encoding)
            else:
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
        # A large batch (or many revisions to try) costs the thread for a while: check it in a worker
        # thread so that the event loop goes on serving other calls meanwhile (the GIL is shared, but the
        # loop gets its turn every few milliseconds instead of waiting for the whole batch).
        work = sum(len(message.data) + 256 for message in messages) * len(validators)
        if work > OFF_LOOP_BYTES:
            matched = await asyncio.to_thread(self._match, settings, validators, encoding, messages)
        else:
            matched = self._match(settings, validators, encoding, messages)
        encoding_name = _encoding_name(encoding)
        for message, revision_id in zip(messages, matched, strict=True):
            attributes = message.attributes
            attributes["googclient_schemaname"] = settings.schema
            attributes["googclient_schemaencoding"] = encoding_name
            attributes["googclient_schemarevisionid"] = revision_id

    @staticmethod
    def _match(
        settings: Any, validators: list[tuple[Any, Validator]], encoding: int, messages: Sequence[Any]
    ) -> list[str]:
        """The revision ID that accepts each message (tried newest first); INVALID_ARGUMENT if none does."""
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
        return matched

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
