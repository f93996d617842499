"""IAM on the local server: the permission each RPC needs, and the permissions each resource knows.

Enforcement is not done yet: :class:`AllowAll` answers every check. The service layer already asks
:meth:`Authorizer.check` once per RPC with the permission from :data:`RPC_PERMISSIONS`, so a real policy
evaluator only has to implement that one method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hedgepub.server._limits import invalid

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

#: Per RPC (short method name): the permissions it needs, each with the request field naming the
#: resource it is checked on. ``*IamPolicy`` methods are resolved by resource type at call time.
RPC_PERMISSIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "CreateTopic": (("pubsub.topics.create", "name"),),
    "GetTopic": (("pubsub.topics.get", "topic"),),
    "UpdateTopic": (("pubsub.topics.update", "topic.name"),),
    "ListTopics": (("pubsub.topics.list", "project"),),
    "ListTopicSubscriptions": (("pubsub.topics.get", "topic"),),
    "DeleteTopic": (("pubsub.topics.delete", "topic"),),
    "DetachSubscription": (("pubsub.subscriptions.detach", "subscription"),),
    "Publish": (("pubsub.topics.publish", "topic"),),
    "CreateSubscription": (
        ("pubsub.subscriptions.create", "name"),
        ("pubsub.topics.attachSubscription", "topic"),
    ),
    "GetSubscription": (("pubsub.subscriptions.get", "subscription"),),
    "UpdateSubscription": (("pubsub.subscriptions.update", "subscription.name"),),
    "ListSubscriptions": (("pubsub.subscriptions.list", "project"),),
    "DeleteSubscription": (("pubsub.subscriptions.delete", "subscription"),),
    "Pull": (("pubsub.subscriptions.consume", "subscription"),),
    "StreamingPull": (("pubsub.subscriptions.consume", "subscription"),),
    "Acknowledge": (("pubsub.subscriptions.consume", "subscription"),),
    "ModifyAckDeadline": (("pubsub.subscriptions.consume", "subscription"),),
    "GetIamPolicy": (("getIamPolicy", "resource"),),
    "SetIamPolicy": (("setIamPolicy", "resource"),),
    "TestIamPermissions": (),
}


def resource_permission(resource: str, verb: str) -> str:
    """``pubsub.topics.<verb>`` or ``pubsub.subscriptions.<verb>`` depending on the resource name."""
    collection = "subscriptions" if "/subscriptions/" in resource else "topics"
    return f"pubsub.{collection}.{verb}"


def check_testable(resource: str, permissions: Sequence[str]) -> None:
    """Refuse permissions that do not apply to the resource's type, as the real service does."""
    known = SUBSCRIPTION_PERMISSIONS if "/subscriptions/" in resource else TOPIC_PERMISSIONS
    for permission in permissions:
        if permission not in known:
            raise invalid(f"Permission {permission} is not valid for resource {resource}.")


class Authorizer(Protocol):
    """Decides whether the caller of an RPC holds a permission on a resource."""

    async def check(
        self, metadata: Sequence[tuple[str, str | bytes]], permission: str, resource: str
    ) -> None:
        """Return if allowed; raise ``ServiceError`` (PERMISSION_DENIED / UNAUTHENTICATED) if not."""

    async def granted(
        self, metadata: Sequence[tuple[str, str | bytes]], resource: str, permissions: Sequence[str]
    ) -> list[str]:
        """The subset of ``permissions`` the caller holds on ``resource`` (for TestIamPermissions)."""


class AllowAll:
    """The default :class:`Authorizer`: IAM policies are stored but not enforced."""

    async def check(
        self, metadata: Sequence[tuple[str, str | bytes]], permission: str, resource: str
    ) -> None:
        """Allow everything."""

    async def granted(
        self, metadata: Sequence[tuple[str, str | bytes]], resource: str, permissions: Sequence[str]
    ) -> list[str]:
        """Every permission asked for."""
        return list(permissions)

    def __repr__(self) -> str:
        return "AllowAll()"
