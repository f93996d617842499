"""The IAM policies set on topics, subscriptions, snapshots and schemas (SetIamPolicy), written through to
the store.

The core checks that a policy's resource exists; IAM enforcement reads the policies through
:meth:`IamPolicies.stored` (it is handed that method when both are built).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from google.iam.v1 import policy_pb2

from hedgepub._status import StatusCode
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._store.protocol import Store

__all__ = ["IamPolicies"]

Policy: Any = policy_pb2.Policy

#: The etag of a resource's policy before any SetIamPolicy: Google's services answer ``etag: ACAB``
#: (base64 of these three bytes), with version 0 and no bindings.
EMPTY_POLICY_ETAG = b"\x00\x20\x01"


class IamPolicies:
    """Resource name -> the policy set on it (none: the resource inherits its project's alone)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._policies: dict[str, Any] = {}

    def load(self, policies: Mapping[str, Any], exists: Callable[[str], bool]) -> list[str]:
        """Take back the stored policies; return (and forget) those whose resource ``exists`` denies.

        A policy is deleted just after its resource: a crash in between leaves it behind, and a resource
        later created under that name must not find it. The caller deletes the returned ones from the store.
        """
        self._policies = dict(policies)
        orphans = [resource for resource in self._policies if not exists(resource)]
        for resource in orphans:
            del self._policies[resource]
        return orphans

    def clear(self) -> None:
        """Forget every policy (the store is cleared by the caller)."""
        self._policies.clear()

    def stored(self, resource: str) -> Any | None:
        """The policy set on ``resource``, or ``None`` (no checks: for IAM enforcement)."""
        return self._policies.get(resource)

    def get(self, resource: str) -> Any:
        """GetIamPolicy of an existing resource: the stored policy, or the empty one the real service
        answers (:data:`EMPTY_POLICY_ETAG`, version 0, no bindings)."""
        policy = self._policies.get(resource)
        if policy is None:
            policy = Policy(etag=EMPTY_POLICY_ETAG)
        return policy

    async def set(self, resource: str, policy: Any) -> Any:
        """SetIamPolicy of an existing resource: replace the policy; a stale etag is refused with ABORTED."""
        current = self.get(resource)
        if policy.etag and policy.etag != current.etag:
            raise ServiceError(
                StatusCode.ABORTED,
                "There were concurrent policy changes. Please retry the whole read-modify-write with "
                "exponential backoff.",
            )
        stored = Policy()
        stored.CopyFrom(policy)
        stored.etag = os.urandom(8)
        if stored.version == 0:
            stored.version = 1
        await self._store.put("policies", resource, stored)
        self._policies[resource] = stored
        return stored

    async def drop(self, resource: str) -> None:
        """A deleted resource's policy goes with it: one re-created under its name starts with none."""
        self._policies.pop(resource, None)
        await self._store.delete("policies", resource)
