"""IAM on the local server: who the caller is, which permission each RPC needs, and who holds it.

Off by default (:class:`AllowAll`: policies are stored and returned, never enforced). Turned on with an
:class:`IamConfig` (``LocalServer(iam=IamConfig(...))``, ``hedgepub serve --iam enforce``), which the server
wraps in an :class:`IamEnforcer`:

- **who**: the caller sends ``authorization: Bearer <token>``; the config's tokens map each token to a
  principal (``user:...``, ``serviceAccount:...``, ``group:...``, or a list of them, which is how a token
  can stand for a user and the groups it belongs to). No token, or an unknown one, is UNAUTHENTICATED.
- **what**: every RPC needs the permissions listed in :data:`RPC_PERMISSIONS`, each on a resource named by a
  request field (the project for ``create`` and ``list``, else the topic, subscription, snapshot or schema).
- **who holds it**: the effective policy of a topic, subscription, snapshot or schema is the project-level
  policy of the config (the same for every project) united with the policy set on the resource through
  SetIamPolicy, as in the real service, where a resource inherits from its project. A binding grants its
  role's permissions (:data:`ROLE_PERMISSIONS`, the real definitions restricted to Pub/Sub's resources) to
  its members: exact principals, ``domain:example.com`` (users of that e-mail domain),
  ``allAuthenticatedUsers`` and ``allUsers`` (both: every caller with a known token).

Refusals use the real service's words (:data:`PERMISSION_DENIED_MESSAGE`, the UNAUTHENTICATED messages,
and :data:`UNSUPPORTED_ROLE_MESSAGE` for a SetIamPolicy naming a role it cannot grant). A permission is
checked before the resource is looked up, so a caller without access learns nothing about what exists
(PERMISSION_DENIED, not NOT_FOUND), again as the real service does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from hedgepub._status import StatusCode
from hedgepub.server._pubsub.limits import ServiceError, check_name, check_project, invalid

#: Permissions that can be tested on a topic.
TOPIC_PERMISSIONS: frozenset[str] = frozenset(
    {
        "pubsub.topics.attachSubscription",
        "pubsub.topics.delete",
        "pubsub.topics.detachSubscription",
        "pubsub.topics.get",
        "pubsub.topics.getIamPolicy",
        "pubsub.topics.publish",
        "pubsub.topics.setIamPolicy",
        "pubsub.topics.update",
        "pubsub.topics.updateTag",
    }
)
#: Permissions that can be tested on a subscription.
SUBSCRIPTION_PERMISSIONS: frozenset[str] = frozenset(
    {
        "pubsub.subscriptions.consume",
        "pubsub.subscriptions.delete",
        "pubsub.subscriptions.get",
        "pubsub.subscriptions.getIamPolicy",
        "pubsub.subscriptions.setIamPolicy",
        "pubsub.subscriptions.update",
    }
)
#: Permissions that only make sense on a project (a policy on a resource cannot grant them): creating and
#: listing resources, and validating a schema or message, all checked on the project they name.
PROJECT_PERMISSIONS: frozenset[str] = frozenset(
    {
        "pubsub.schemas.create",
        "pubsub.schemas.list",
        "pubsub.schemas.validate",
        "pubsub.snapshots.create",
        "pubsub.snapshots.list",
        "pubsub.subscriptions.create",
        "pubsub.subscriptions.list",
        "pubsub.topics.create",
        "pubsub.topics.list",
    }
)
#: Permissions that can be tested on a schema (granted by the project's policy and the schema's own).
SCHEMA_PERMISSIONS: frozenset[str] = frozenset(
    {
        "pubsub.schemas.attach",
        "pubsub.schemas.commit",
        "pubsub.schemas.delete",
        "pubsub.schemas.get",
        "pubsub.schemas.getIamPolicy",
        "pubsub.schemas.listRevisions",
        "pubsub.schemas.rollback",
        "pubsub.schemas.setIamPolicy",
    }
)
#: Permissions that can be tested on a snapshot (granted by the project's policy and the snapshot's own).
SNAPSHOT_PERMISSIONS: frozenset[str] = frozenset(
    {
        "pubsub.snapshots.delete",
        "pubsub.snapshots.get",
        "pubsub.snapshots.getIamPolicy",
        "pubsub.snapshots.seek",
        "pubsub.snapshots.setIamPolicy",
        "pubsub.snapshots.update",
    }
)
#: Per resource type (the collection in its name): the permissions TestIamPermissions accepts for it.
TESTABLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "topics": TOPIC_PERMISSIONS,
    "subscriptions": SUBSCRIPTION_PERMISSIONS,
    "snapshots": SNAPSHOT_PERMISSIONS,
    "schemas": SCHEMA_PERMISSIONS,
}
ALL_PERMISSIONS: frozenset[str] = (
    TOPIC_PERMISSIONS
    | SUBSCRIPTION_PERMISSIONS
    | PROJECT_PERMISSIONS
    | SCHEMA_PERMISSIONS
    | SNAPSHOT_PERMISSIONS
)

_VIEW = frozenset(
    {
        "pubsub.subscriptions.get",
        "pubsub.subscriptions.list",
        "pubsub.topics.get",
        "pubsub.topics.list",
        "pubsub.schemas.get",
        "pubsub.schemas.list",
        "pubsub.schemas.listRevisions",
        "pubsub.snapshots.get",
        "pubsub.snapshots.list",
    }
)
_GET_POLICY = frozenset(f"pubsub.{collection}.getIamPolicy" for collection in TESTABLE_PERMISSIONS)
_SET_POLICY = frozenset(f"pubsub.{collection}.setIamPolicy" for collection in TESTABLE_PERMISSIONS)
_EDIT = ALL_PERMISSIONS - _GET_POLICY - _SET_POLICY

#: The real roles, restricted to the Pub/Sub permissions this server knows (topics, subscriptions, snapshots
#: and schemas).
#: The Pub/Sub editor manages and uses resources but cannot read or change their policies; the basic editor
#: can read them; the basic viewer sees configurations and policies but cannot publish or consume.
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "roles/pubsub.publisher": frozenset({"pubsub.topics.publish"}),
    "roles/pubsub.subscriber": frozenset(
        {"pubsub.subscriptions.consume", "pubsub.topics.attachSubscription", "pubsub.snapshots.seek"}
    ),
    "roles/pubsub.viewer": _VIEW,
    "roles/pubsub.editor": _EDIT,
    "roles/pubsub.admin": ALL_PERMISSIONS,
    "roles/owner": ALL_PERMISSIONS,
    "roles/editor": _EDIT | _GET_POLICY,
    "roles/viewer": _VIEW | _GET_POLICY,
}

#: The real service's PERMISSION_DENIED message.
PERMISSION_DENIED_MESSAGE = "User not authorized to perform this action."
_SEE = "See https://developers.google.com/identity/sign-in/web/devconsole-project."
#: The real service's UNAUTHENTICATED messages: no credential at all, and one it does not accept.
MISSING_CREDENTIALS_MESSAGE = (
    "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie "
    f"or other valid authentication credential. {_SEE}"
)
INVALID_CREDENTIALS_MESSAGE = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other "
    f"valid authentication credential. {_SEE}"
)

#: The real service's INVALID_ARGUMENT message for a SetIamPolicy binding with a role it does not know.
UNSUPPORTED_ROLE_MESSAGE = "Role {role} is not supported for this resource."
#: The real service's INVALID_ARGUMENT message for a SetIamPolicy member not of IAM's forms.
INVALID_MEMBER_MESSAGE = 'Policy members must be of the form "<type>:<value>".'

_MEMBER_PREFIXES = ("user:", "serviceAccount:", "group:", "domain:")
_PUBLIC_MEMBERS = frozenset({"allUsers", "allAuthenticatedUsers"})
_PRINCIPAL_PREFIXES = ("user:", "serviceAccount:", "group:")


class Check(NamedTuple):
    """One permission an RPC needs, on the resource named by a request field."""

    permission: str
    #: Dotted path of the request field naming the resource (``topic.name`` for UpdateTopic).
    field: str
    #: The field names a subscription, and the permission is checked on that subscription's topic.
    on_topic: bool = False
    #: The field may be empty (the request names no such resource): then there is nothing to check.
    optional: bool = False
    #: Checked only when the request's ``update_mask`` names this field (or a field inside it).
    when_masked: str = ""


#: Per RPC (short method name): the permissions it needs. ``create`` and ``list`` are checked on the
#: project of the named resource; ``pubsub.schemas.attach`` on the schema a topic names (granted by the
#: project's policy or the schema's own). ``getIamPolicy`` /
#: ``setIamPolicy`` are completed with the resource's type (``topics``, ``subscriptions``, ...) at call
#: time (:func:`resource_permission`). TestIamPermissions needs no permission (any authenticated caller may
#: ask), as in the real service.
RPC_PERMISSIONS: dict[str, tuple[Check, ...]] = {
    # A topic that names a schema attaches it: the caller needs pubsub.schemas.attach on that schema too.
    "CreateTopic": (
        Check("pubsub.topics.create", "name"),
        Check("pubsub.schemas.attach", "schema_settings.schema", optional=True),
    ),
    "GetTopic": (Check("pubsub.topics.get", "topic"),),
    "UpdateTopic": (
        Check("pubsub.topics.update", "topic.name"),
        Check(
            "pubsub.schemas.attach",
            "topic.schema_settings.schema",
            optional=True,
            when_masked="schema_settings",
        ),
    ),
    "ListTopics": (Check("pubsub.topics.list", "project"),),
    "ListTopicSubscriptions": (Check("pubsub.topics.get", "topic"),),
    "DeleteTopic": (Check("pubsub.topics.delete", "topic"),),
    # Needs nothing on the subscription itself: a topic's owner may detach another project's subscription.
    "DetachSubscription": (Check("pubsub.topics.detachSubscription", "subscription", on_topic=True),),
    "Publish": (Check("pubsub.topics.publish", "topic"),),
    "CreateSubscription": (
        Check("pubsub.subscriptions.create", "name"),
        Check("pubsub.topics.attachSubscription", "topic"),
    ),
    "GetSubscription": (Check("pubsub.subscriptions.get", "subscription"),),
    "UpdateSubscription": (Check("pubsub.subscriptions.update", "subscription.name"),),
    "ModifyPushConfig": (Check("pubsub.subscriptions.update", "subscription"),),
    "ListSubscriptions": (Check("pubsub.subscriptions.list", "project"),),
    "DeleteSubscription": (Check("pubsub.subscriptions.delete", "subscription"),),
    "Pull": (Check("pubsub.subscriptions.consume", "subscription"),),
    "StreamingPull": (Check("pubsub.subscriptions.consume", "subscription"),),
    "Acknowledge": (Check("pubsub.subscriptions.consume", "subscription"),),
    "ModifyAckDeadline": (Check("pubsub.subscriptions.consume", "subscription"),),
    "GetIamPolicy": (Check("getIamPolicy", "resource"),),
    "SetIamPolicy": (Check("setIamPolicy", "resource"),),
    "TestIamPermissions": (),
    "CreateSchema": (Check("pubsub.schemas.create", "parent"),),
    "GetSchema": (Check("pubsub.schemas.get", "name"),),
    "ListSchemas": (Check("pubsub.schemas.list", "parent"),),
    "ListSchemaRevisions": (Check("pubsub.schemas.listRevisions", "name"),),
    "CommitSchema": (Check("pubsub.schemas.commit", "name"),),
    "RollbackSchema": (Check("pubsub.schemas.rollback", "name"),),
    "DeleteSchemaRevision": (Check("pubsub.schemas.delete", "name"),),
    "DeleteSchema": (Check("pubsub.schemas.delete", "name"),),
    "ValidateSchema": (Check("pubsub.schemas.validate", "parent"),),
    "ValidateMessage": (Check("pubsub.schemas.validate", "parent"),),
    "CreateSnapshot": (
        Check("pubsub.snapshots.create", "name"),
        Check("pubsub.subscriptions.consume", "subscription"),
    ),
    "GetSnapshot": (Check("pubsub.snapshots.get", "snapshot"),),
    "ListSnapshots": (Check("pubsub.snapshots.list", "project"),),
    "UpdateSnapshot": (Check("pubsub.snapshots.update", "snapshot.name"),),
    "DeleteSnapshot": (Check("pubsub.snapshots.delete", "snapshot"),),
    # Seeking to a snapshot also needs pubsub.snapshots.seek on it (a Seek to a time names no snapshot).
    "Seek": (
        Check("pubsub.subscriptions.consume", "subscription"),
        Check("pubsub.snapshots.seek", "snapshot", optional=True),
    ),
    "ListTopicSnapshots": (Check("pubsub.topics.get", "topic"),),
}

Metadata = Sequence[tuple[str, "str | bytes"]]

#: The identity the local server forwards dead-lettered messages as. The real service publishes them as its
#: per-project service agent, ``service-{project_number}@gcp-sa-pubsub.iam.gserviceaccount.com``; local
#: projects have no numbers, so the project ID stands in for the number.
FORWARDING_IDENTITY = "serviceAccount:service-{project}@gcp-sa-pubsub.iam.gserviceaccount.com"


def forwarding_identity(resource: str) -> str:
    """The principal that forwards dead-lettered messages of ``resource``'s project (a subscription)."""
    return FORWARDING_IDENTITY.format(project=resource.split("/")[1] if resource.count("/") >= 1 else "")


def _collection(resource: str) -> str:
    """The type (a key of :data:`TESTABLE_PERMISSIONS`) of ``projects/p/<collection>/id``; else ''."""
    parts = resource.split("/")
    return parts[2] if len(parts) == 4 and parts[2] in TESTABLE_PERMISSIONS else ""


def resource_permission(resource: str, verb: str) -> str:
    """``pubsub.<collection>.<verb>`` for the resource's type (``topics`` for a name of no known type)."""
    return f"pubsub.{_collection(resource) or 'topics'}.{verb}"


def testable_permissions(resource: str) -> frozenset[str]:
    """The permissions TestIamPermissions accepts for ``resource``'s type; INVALID_ARGUMENT for no type."""
    known = TESTABLE_PERMISSIONS.get(_collection(resource))
    if known is None:
        raise invalid(
            f"Invalid resource name given (name={resource}). Expected a topic, subscription, snapshot or "
            "schema."
        )
    return known


def check_testable(resource: str, permissions: Sequence[str]) -> None:
    """Refuse permissions that do not apply to the resource's type, as the real service does."""
    known = testable_permissions(resource)
    for permission in permissions:
        if permission not in known:
            raise invalid(f"Permission {permission} is not valid for resource {resource}.")


class Authorizer(Protocol):
    """Decides whether the caller of an RPC holds a permission on a resource."""

    async def check(self, metadata: Metadata, permission: str, resource: str) -> None:
        """Return if allowed; raise ``ServiceError`` (PERMISSION_DENIED / UNAUTHENTICATED) if not."""

    async def granted(self, metadata: Metadata, resource: str, permissions: Sequence[str]) -> list[str]:
        """The subset of ``permissions`` the caller holds on ``resource`` (for TestIamPermissions)."""


class AllowAll:
    """The default :class:`Authorizer`: IAM policies are stored but not enforced."""

    def authenticate(self, metadata: Metadata) -> None:
        """Anyone (an authorizer may offer this to check the caller before any lookup)."""

    async def check(self, metadata: Metadata, permission: str, resource: str) -> None:
        """Allow everything."""

    async def granted(self, metadata: Metadata, resource: str, permissions: Sequence[str]) -> list[str]:
        """Every permission asked for."""
        return list(permissions)

    def __repr__(self) -> str:
        return "AllowAll()"


# --------------------------------------------------------------------------------------------- config
class IamConfigError(ValueError):
    """A tokens file or policy that cannot be used; the message names the file and the entry."""


def _normalize_member(member: str) -> str:
    """E-mail addresses and domains compare without regard to case, as in IAM."""
    kind, colon, rest = member.partition(":")
    return f"{kind}:{rest.lower()}" if colon else member


def _check_principal(principal: object, where: str) -> str:
    if not isinstance(principal, str) or not principal.startswith(_PRINCIPAL_PREFIXES):
        raise IamConfigError(
            f"{where}: a principal must be a string starting with user:, serviceAccount: or group:; "
            f"got {principal!r}"
        )
    if "@" not in principal:
        raise IamConfigError(f"{where}: {principal!r} is not of the form kind:e-mail address")
    return _normalize_member(principal)


def parse_tokens(data: object, source: str = "tokens") -> dict[str, tuple[str, ...]]:
    """Check a tokens mapping (token -> principal, or -> list of principals) and normalize it."""
    if not isinstance(data, Mapping):
        raise IamConfigError(
            f'{source}: expected a JSON object from token to principal, like {{"t-alice": '
            f'"user:alice@example.com"}}; got {type(data).__name__}'
        )
    tokens: dict[str, tuple[str, ...]] = {}
    for token, principals in data.items():
        where = f"{source}: token {token!r}"
        if not isinstance(token, str) or not token or any(c.isspace() for c in token):
            raise IamConfigError(f"{where}: a token must be a non-empty string without spaces")
        listed = [principals] if isinstance(principals, str) else principals
        if not isinstance(listed, (list, tuple)) or not listed:
            raise IamConfigError(f"{where}: expected a principal or a non-empty list of principals")
        tokens[token] = tuple(_check_principal(principal, where) for principal in listed)
    return tokens


def _check_member(member: object, where: str) -> str:
    if isinstance(member, str) and member in _PUBLIC_MEMBERS:
        return member
    if not isinstance(member, str) or not member.startswith(_MEMBER_PREFIXES) or member.endswith(":"):
        raise IamConfigError(
            f"{where}: unknown member {member!r}; members are user:, serviceAccount:, group:, domain: "
            "followed by an address or domain, allUsers or allAuthenticatedUsers"
        )
    return _normalize_member(member)


def parse_policy(data: object, source: str = "policy") -> dict[str, frozenset[str]]:
    """Check a policy in IAM's JSON form (``{"bindings": [{"role": ..., "members": [...]}]}``).

    Returns role -> members. Unknown roles, unknown member kinds and conditional bindings are refused.
    """
    if not isinstance(data, Mapping):
        raise IamConfigError(f'{source}: expected a JSON object like {{"bindings": [...]}}')
    unknown_keys = set(data) - {"bindings", "etag", "version", "auditConfigs"}
    if unknown_keys:
        raise IamConfigError(f"{source}: unknown field(s) {', '.join(sorted(unknown_keys))}")
    bindings = data.get("bindings", [])
    if not isinstance(bindings, list):
        raise IamConfigError(f"{source}: 'bindings' must be a list")
    roles: dict[str, set[str]] = {}
    for index, binding in enumerate(bindings):
        where = f"{source}: bindings[{index}]"
        if not isinstance(binding, Mapping):
            raise IamConfigError(f"{where}: expected an object with 'role' and 'members'")
        if "condition" in binding:
            raise IamConfigError(f"{where}: conditional bindings are not supported by the local server")
        role = binding.get("role")
        if role not in ROLE_PERMISSIONS:
            raise IamConfigError(
                f"{where}: unknown role {role!r}; known roles: {', '.join(sorted(ROLE_PERMISSIONS))}"
            )
        members = binding.get("members")
        if not isinstance(members, list):
            raise IamConfigError(f"{where}: 'members' must be a list")
        roles.setdefault(role, set()).update(_check_member(member, where) for member in members)
    return {role: frozenset(members) for role, members in roles.items()}


def _read_json(path: str | os.PathLike[str], what: str) -> object:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise IamConfigError(f"cannot read the {what} file {os.fspath(path)}: {error.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise IamConfigError(f"{os.fspath(path)}: not valid JSON ({error})") from None


class IamConfig:
    """What an enforcing server knows: which token is whom, and the policy every project starts with.

    ``tokens`` maps a bearer token to a principal (``"user:alice@example.com"``) or a list of them;
    ``policy`` is the project-level policy in IAM's JSON form, applied to every project. Both are checked
    here (:class:`IamConfigError`, a ``ValueError``, names the bad entry).
    """

    def __init__(
        self, tokens: Mapping[str, str | Sequence[str]], policy: Mapping[str, Any] | None = None
    ) -> None:
        self.tokens: Mapping[str, tuple[str, ...]] = parse_tokens(tokens)
        self.project_policy: Mapping[str, frozenset[str]] = parse_policy(policy if policy is not None else {})

    @classmethod
    def from_files(
        cls, tokens_file: str | os.PathLike[str], policy_file: str | os.PathLike[str] | None = None
    ) -> IamConfig:
        """Read the tokens file and (optionally) the project policy file, both JSON."""
        tokens = parse_tokens(_read_json(tokens_file, "tokens"), os.fspath(tokens_file))
        policy: Any = None
        if policy_file is not None:
            policy = _read_json(policy_file, "policy")
            parse_policy(policy, os.fspath(policy_file))  # errors name the file, not just "policy"
        return cls(tokens, policy)

    def __repr__(self) -> str:
        return f"IamConfig({len(self.tokens)} tokens, project roles: {sorted(self.project_policy)})"


# ------------------------------------------------------------------------------------------- enforcer
def _unauthenticated(message: str) -> ServiceError:
    return ServiceError(StatusCode.UNAUTHENTICATED, message)


def _denied() -> ServiceError:
    return ServiceError(StatusCode.PERMISSION_DENIED, PERMISSION_DENIED_MESSAGE)


def _project_of(resource: str) -> str:
    """``projects/p`` of a project, topic, subscription or schema (revision) name; else INVALID_ARGUMENT."""
    parts = resource.split("/")
    if len(parts) == 2:
        check_project(resource)
    elif len(parts) == 4 and parts[2] in ("topics", "subscriptions"):
        check_name(resource, parts[2])
    elif len(parts) == 4 and parts[2] == "schemas":
        check_name(resource.partition("@")[0], "schemas")
    elif len(parts) == 4 and parts[2] == "snapshots":
        check_name(resource, "snapshots")
    else:
        raise invalid(
            f"Invalid resource name given (name={resource}). Expected a project, topic, subscription or "
            "schema."
        )
    return "/".join(parts[:2])


def _bindings(policy: Any) -> Iterable[tuple[str, Iterable[str]]]:
    """(role, members) of a stored ``google.iam.v1.Policy``; conditional bindings grant nothing here."""
    for binding in policy.bindings:
        if binding.HasField("condition"):
            continue
        yield binding.role, binding.members


def check_policy(policy: Any) -> None:
    """SetIamPolicy, enforcing or not: refuse a binding whose role is not known here
    (:data:`UNSUPPORTED_ROLE_MESSAGE`) or a member not of IAM's ``<type>:<value>`` form
    (:data:`INVALID_MEMBER_MESSAGE`), with INVALID_ARGUMENT, as the real service does."""
    for binding in policy.bindings:
        if binding.role not in ROLE_PERMISSIONS:
            raise invalid(UNSUPPORTED_ROLE_MESSAGE.format(role=binding.role))
        for member in binding.members:
            if not valid_member(member):
                raise invalid(f"{INVALID_MEMBER_MESSAGE} (member={member})")


def valid_member(member: str) -> bool:
    """Whether ``member`` has one of IAM's forms: ``allUsers``, ``allAuthenticatedUsers``, or a kind this
    server knows (``user:``, ``serviceAccount:``, ``group:`` with an e-mail address; ``domain:`` with a
    domain; ``deleted:`` with one of those) followed by a value."""
    if member in _PUBLIC_MEMBERS:
        return True
    if member.startswith("deleted:"):
        member = member[len("deleted:") :].partition("?uid=")[0]
    kind, colon, value = member.partition(":")
    if not colon or not value or any(c.isspace() for c in value) or f"{kind}:" not in _MEMBER_PREFIXES:
        return False
    if kind == "domain":
        return "@" not in value and "." in value.strip(".")
    local, at, domain = value.partition("@")
    return bool(local) and bool(at) and "." in domain.strip(".") and "@" not in domain


class IamEnforcer:
    """The enforcing :class:`Authorizer`: the config's tokens and project policy, plus resource policies.

    ``policy_of(resource)`` returns the policy stored on a topic, subscription, snapshot or schema through
    SetIamPolicy (``None`` if there is none); the server binds it to its core.
    """

    def __init__(self, config: IamConfig, policy_of: Callable[[str], Any | None] | None = None) -> None:
        self.config = config
        self._policy_of = policy_of or (lambda resource: None)

    def principals(self, metadata: Metadata) -> tuple[str, ...]:
        """Who the caller is, from ``authorization: Bearer <token>``; UNAUTHENTICATED if unknown."""
        header: str | bytes | None = None
        for key, value in metadata:
            if key.lower() == "authorization":
                header = value
                break
        if header is None:
            raise _unauthenticated(MISSING_CREDENTIALS_MESSAGE)
        if isinstance(header, bytes):
            header = header.decode("utf-8", "replace")
        scheme, _, token = header.strip().partition(" ")
        principals = self.config.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if principals is None:
            raise _unauthenticated(INVALID_CREDENTIALS_MESSAGE)
        return principals

    @staticmethod
    def _matches(member: str, principals: tuple[str, ...]) -> bool:
        if member in _PUBLIC_MEMBERS or member in principals:
            return True
        if member.startswith("domain:"):
            suffix = "@" + member[len("domain:") :]
            return any(p.startswith("user:") and p.endswith(suffix) for p in principals)
        return False

    def permissions(self, principals: tuple[str, ...], resource: str) -> set[str]:
        """Every permission the principals hold on ``resource`` (project policy plus resource policy)."""
        _project_of(resource)
        held: set[str] = set()
        for role, members in self.config.project_policy.items():
            if any(self._matches(member, principals) for member in members):
                held |= ROLE_PERMISSIONS[role]
        if resource.count("/") == 3:
            # A schema revision (``schema@revision``) is governed by its schema's policy.
            policy = self._policy_of(resource.partition("@")[0])
            if policy is not None:
                applicable = TESTABLE_PERMISSIONS.get(_collection(resource), frozenset())
                for role, bound in _bindings(policy):
                    # Unknown roles grant nothing (SetIamPolicy refuses them while enforcing, but a policy
                    # stored while enforcement was off may hold any role).
                    role_permissions = ROLE_PERMISSIONS.get(role, frozenset()) & applicable
                    if role_permissions and any(
                        self._matches(_normalize_member(member), principals) for member in bound
                    ):
                        held |= role_permissions
        return held

    def authenticate(self, metadata: Metadata) -> tuple[str, ...]:
        """Who the caller is (UNAUTHENTICATED if unknown); the services call it before looking anything up."""
        return self.principals(metadata)

    def may_forward(self, subscription: str, dead_letter_topic: str) -> bool:
        """Whether the topic grants the forwarding identity of ``subscription``'s project publishing."""
        identity = (_normalize_member(forwarding_identity(subscription)),)
        try:
            return "pubsub.topics.publish" in self.permissions(identity, dead_letter_topic)
        except ServiceError:  # a malformed topic name grants nothing
            return False

    def check_dead_letter_topic(self, subscription: str, dead_letter_topic: str) -> None:
        """Create/UpdateSubscription with a dead-letter policy: the service must be able to forward.

        The real service documents that its service agent must be allowed to publish to the dead-letter
        topic (``DeadLetterPolicy.dead_letter_topic``). Here a topic that does not grant
        :func:`forwarding_identity` ``pubsub.topics.publish`` is refused with PERMISSION_DENIED, its
        answer to a missing permission, so the missing grant shows at once and a caller cannot route
        messages to a topic that has not opted in; a grant withdrawn later stops forwarding
        (:meth:`may_forward`).
        """
        _project_of(dead_letter_topic)  # INVALID_ARGUMENT for a malformed name, as before
        if not self.may_forward(subscription, dead_letter_topic):
            raise _denied()

    async def check(self, metadata: Metadata, permission: str, resource: str) -> None:
        """Allow, or raise UNAUTHENTICATED / INVALID_ARGUMENT (bad name) / PERMISSION_DENIED."""
        principals = self.principals(metadata)
        if permission not in self.permissions(principals, resource):
            raise _denied()

    async def granted(self, metadata: Metadata, resource: str, permissions: Sequence[str]) -> list[str]:
        """The asked permissions the caller holds on ``resource``, in the order asked."""
        held = self.permissions(self.principals(metadata), resource)
        return [permission for permission in permissions if permission in held]

    def __repr__(self) -> str:
        return f"IamEnforcer({self.config!r})"
