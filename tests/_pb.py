"""The raw protobuf classes of ``google.pubsub.v1`` (``types.X.pb()`` of the proto-plus types), for the
tests that build requests and stored resources by hand, as the server itself does (DESIGN: protobuf
classes come from the installed client package, never through proto-plus on hot paths).

Typed ``Any``: the generated classes carry no static types.
"""

from __future__ import annotations

from typing import Any

from google.pubsub_v1.types import pubsub as types

AcknowledgeRequest: Any = types.AcknowledgeRequest.pb()
ExpirationPolicy: Any = types.ExpirationPolicy.pb()
GetSubscriptionRequest: Any = types.GetSubscriptionRequest.pb()
ModifyAckDeadlineRequest: Any = types.ModifyAckDeadlineRequest.pb()
PublishRequest: Any = types.PublishRequest.pb()
PublishResponse: Any = types.PublishResponse.pb()
PubsubMessage: Any = types.PubsubMessage.pb()
PullRequest: Any = types.PullRequest.pb()
PullResponse: Any = types.PullResponse.pb()
RetryPolicy: Any = types.RetryPolicy.pb()
Snapshot: Any = types.Snapshot.pb()
StreamingPullRequest: Any = types.StreamingPullRequest.pb()
StreamingPullResponse: Any = types.StreamingPullResponse.pb()
Subscription: Any = types.Subscription.pb()
Topic: Any = types.Topic.pb()
UpdateSubscriptionRequest: Any = types.UpdateSubscriptionRequest.pb()
