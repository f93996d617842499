"""The official client's constructor arguments, translated to hedgepub's settings.

``hedgepub.PublisherClient`` accepts what ``google.cloud.pubsub_v1.PublisherClient`` accepts, so that moving
is one import plus ``hedging_settings=``:

* ``batch_settings=types.BatchSettings(max_bytes, max_latency, max_messages)`` -> ``BatchSettings``
  with the same three fields;
* ``PublisherOptions.enable_message_ordering`` -> ``enable_message_ordering``;
* ``PublisherOptions.flow_control=types.PublishFlowControl(...)`` -> ``FlowControlSettings`` (same fields);
* ``PublisherOptions.retry=api_core.retry.Retry(initial, maximum, multiplier, timeout, predicate)`` ->
  ``RetrySettings(initial_retry_delay, max_retry_delay, retry_delay_multiplier, total_timeout,
  retryable_codes)``; ``retry=None`` -> no retries;
* ``PublisherOptions.timeout`` (seconds, ``ConstantTimeout``, ``ExponentialTimeout``) -> the per-attempt
  RPC timeout (``initial_rpc_timeout``, ``rpc_timeout_multiplier``, ``max_rpc_timeout``);
* ``PublisherOptions.enable_open_telemetry_tracing`` -> ``enable_open_telemetry``;
* ``client_options={"api_endpoint": ...}`` (or a ``ClientOptions``) -> ``endpoint``, unless
  ``PUBSUB_EMULATOR_HOST`` is set, which wins as in the official client; ``credentials_file`` ->
  ``credentials`` loaded from that file; ``tracer_provider`` -> ``tracer_provider``;
* ``credentials`` -> ``credentials``.

Options left at the official defaults leave hedgepub's defaults (those of the reference publishers) alone.
Anything else (a retry predicate that is not ``if_exception_type``, ``on_error``, ``client_info``, a GAPIC
``transport``, other ``client_options`` fields) is refused with a ``TypeError`` or ``ValueError`` that says
what to use instead: silently dropping a setting would change behaviour without anyone noticing.

The official types are recognised by their module and name, so this module imports nothing of
``google.cloud.pubsub_v1`` (whose import costs a noticeable fraction of a second).
"""

from __future__ import annotations

import os
from typing import Any

from hedgepub._settings import BatchSettings, FlowControlSettings, RetrySettings
from hedgepub._status import StatusCode
from hedgepub._wire import EMULATOR_HOST_ENV

_OFFICIAL_TYPES = "google.cloud.pubsub_v1.types"
_DEFAULT_RETRY = RetrySettings()


def _is_official(value: object, name: str) -> bool:
    kind = type(value)
    return kind.__name__ == name and kind.__module__ == _OFFICIAL_TYPES


def is_official_batch_settings(value: object) -> bool:
    """Whether ``value`` is a ``google.cloud.pubsub_v1.types.BatchSettings``."""
    return _is_official(value, "BatchSettings")


def is_official_publisher_options(value: object) -> bool:
    """Whether ``value`` is a ``google.cloud.pubsub_v1.types.PublisherOptions``."""
    return _is_official(value, "PublisherOptions")


def batch_settings(official: Any) -> BatchSettings:
    """``types.BatchSettings`` (or the empty tuple the official client takes as "defaults") in hedgepub's."""
    if isinstance(official, tuple) and not official:
        return BatchSettings()
    return BatchSettings(
        max_messages=official.max_messages, max_bytes=official.max_bytes, max_latency=official.max_latency
    )


def flow_control(official: Any) -> FlowControlSettings:
    """``types.PublishFlowControl`` in hedgepub's settings (the behaviour enum has the same values)."""
    behavior = getattr(official.limit_exceeded_behavior, "value", official.limit_exceeded_behavior)
    return FlowControlSettings(
        message_limit=official.message_limit,
        byte_limit=official.byte_limit,
        limit_exceeded_behavior=behavior,
    )


def _retryable_codes(predicate: Any) -> frozenset[StatusCode]:
    """The status codes an ``api_core.retry.if_exception_type(...)`` predicate retries.

    A status is retried when the exception the official client raises for it is one of the predicate's
    types (or a subclass, as ``isinstance`` decides): ``TooManyRequests`` covers ``RESOURCE_EXHAUSTED``.
    Types that no gRPC status raises (HTTP connection errors) cannot occur here and add nothing.
    """
    qualname = getattr(predicate, "__qualname__", "")
    closure: tuple[Any, ...] = getattr(predicate, "__closure__", None) or ()
    if not (qualname.startswith("if_exception_type.") and len(closure) == 1):
        raise ValueError(
            f"publisher_options.retry has a custom predicate ({predicate!r}) that hedgepub cannot read; "
            "build it with google.api_core.retry.if_exception_type(...), or pass "
            "retry_settings=hedgepub.RetrySettings(retryable_codes=...) instead"
        )
    import grpc
    from google.api_core import exceptions

    exception_types = tuple(closure[0].cell_contents)
    return frozenset(
        StatusCode(code.value[0])
        for code in grpc.StatusCode
        if code is not grpc.StatusCode.OK
        and issubclass(exceptions.exception_class_for_grpc_status(code), exception_types)
    )


def _retry_fields(retry: Any) -> dict[str, Any]:
    if retry is None:  # the official client then sends each batch once
        return {"retryable_codes": frozenset()}
    if getattr(retry, "_on_error", None) is not None:
        raise ValueError(
            "publisher_options.retry has an on_error callback, which hedgepub does not call; read "
            "PublisherClient.stats() or the OpenTelemetry metrics (enable_open_telemetry=True) instead"
        )
    missing = [
        name for name in ("_initial", "_maximum", "_multiplier", "_predicate") if not hasattr(retry, name)
    ]
    if missing:
        raise TypeError(
            "publisher_options.retry must be a google.api_core.retry.Retry or None; got "
            f"{type(retry).__name__}; or pass retry_settings=hedgepub.RetrySettings(...)"
        )
    fields: dict[str, Any] = {
        "initial_retry_delay": retry._initial,
        "max_retry_delay": retry._maximum,
        "retry_delay_multiplier": retry._multiplier,
        "retryable_codes": _retryable_codes(retry._predicate),
    }
    total = getattr(retry, "_timeout", None)
    if total is not None:
        fields["total_timeout"] = total
    return fields


def _timeout_fields(timeout: Any) -> dict[str, Any]:
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return {"initial_rpc_timeout": timeout, "max_rpc_timeout": timeout, "rpc_timeout_multiplier": 1.0}
    kind = type(timeout).__name__
    if kind == "ConstantTimeout":
        value = timeout._timeout
        if value is None:  # no per-attempt limit: an attempt may use the whole deadline
            return {"per_attempt_unbounded": True}
        return _timeout_fields(value)
    if kind == "ExponentialTimeout":
        fields: dict[str, Any] = {
            "initial_rpc_timeout": timeout._initial,
            "max_rpc_timeout": timeout._maximum,
            "rpc_timeout_multiplier": timeout._multiplier,
        }
        if timeout._deadline is not None:
            fields["total_timeout"] = timeout._deadline
        return fields
    if timeout is None:
        return {"per_attempt_unbounded": True}
    raise TypeError(
        f"publisher_options.timeout must be seconds, a ConstantTimeout or an ExponentialTimeout; got {kind}; "
        "or pass retry_settings=hedgepub.RetrySettings(initial_rpc_timeout=...) instead"
    )


def retry_settings(
    official_retry: Any, official_timeout: Any, retry_given: bool, timeout_given: bool
) -> RetrySettings:
    """``PublisherOptions.retry`` and ``.timeout`` as one :class:`~hedgepub.RetrySettings`.

    Either may be left at the official default (``retry_given`` / ``timeout_given`` false): hedgepub's
    own defaults (those of the reference publishers) stand for it.
    """
    fields: dict[str, Any] = {}
    if retry_given:
        fields.update(_retry_fields(official_retry))
    if timeout_given:
        timeout_fields = _timeout_fields(official_timeout)
        deadline = timeout_fields.pop("total_timeout", None)
        if deadline is not None:
            fields["total_timeout"] = min(deadline, fields.get("total_timeout", deadline))
        if timeout_fields.pop("per_attempt_unbounded", False):
            total = fields.get("total_timeout", _DEFAULT_RETRY.total_timeout)
            timeout_fields = {"initial_rpc_timeout": total, "max_rpc_timeout": total}
        fields.update(timeout_fields)
    if "max_retry_delay" in fields and "initial_retry_delay" in fields:
        fields["max_retry_delay"] = max(fields["max_retry_delay"], fields["initial_retry_delay"])
    return RetrySettings(**fields)


_CLIENT_OPTION_ADVICE = {
    "client_cert_source": "mutual TLS is not supported",
    "client_encrypted_cert_source": "mutual TLS is not supported",
    "quota_project_id": "pass credentials=credentials.with_quota_project(...) instead",
    "scopes": "pass credentials=credentials.with_scopes(...) instead",
    "api_key": "Pub/Sub publishing needs OAuth credentials; pass credentials=... instead",
    "api_audience": "pass credentials that carry their own audience instead",
}


def _official_endpoint(api_endpoint: str) -> str:
    """``api_endpoint`` as the official client reads it: a host without a port is TLS on 443 (hedgepub's
    own ``endpoint`` takes that only for ``*.googleapis.com``, and asks for the port otherwise)."""
    text = api_endpoint.strip()
    if "://" in text or text.startswith("unix") or text.rsplit("]", 1)[-1].count(":") == 1:
        return text
    return f"https://{text}"


def client_options(options: Any, environ: Any = None) -> dict[str, Any]:
    """``client_options`` (a dict or ``google.api_core.client_options.ClientOptions``) as hedgepub arguments.

    Returns ``endpoint`` (unless ``PUBSUB_EMULATOR_HOST`` is set, which the official client lets win too)
    and ``credentials`` (from ``credentials_file``) when given.
    """
    environ = os.environ if environ is None else environ
    values = dict(options) if isinstance(options, dict) else dict(vars(options))
    translated: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name == "api_endpoint":
            if not environ.get(EMULATOR_HOST_ENV):
                translated["endpoint"] = _official_endpoint(value)
        elif name == "credentials_file":
            import google.auth

            from hedgepub._transport.grpc import SCOPES

            translated["credentials"], _project = google.auth.load_credentials_from_file(value, scopes=SCOPES)
        elif name == "tracer_provider":
            translated["tracer_provider"] = value
        elif name == "universe_domain" and value == "googleapis.com":
            continue
        else:
            advice = _CLIENT_OPTION_ADVICE.get(name, "pass endpoint= or credentials= to hedgepub instead")
            raise ValueError(f"client_options.{name} cannot be mapped to hedgepub: {advice}")
    return translated


def refuse_official_keywords(extra: dict[str, Any]) -> None:
    """Refuse keyword arguments of the official client that hedgepub has no counterpart for."""
    for name in extra:
        if name == "client_info":
            raise TypeError(
                "client_info (user-agent details for the official client) cannot be mapped to hedgepub: "
                "drop it; hedgepub identifies its attempts with the x-goog-pubsub-client-telemetry and "
                "hedgepub-batch-id metadata"
            )
        raise TypeError(f"PublisherClient() got an unexpected keyword argument {name!r}")


def publisher_options(options: Any) -> dict[str, Any]:
    """``types.PublisherOptions`` as hedgepub keyword arguments (only the fields that differ from the
    official defaults, so hedgepub's own defaults stand for the rest)."""
    if isinstance(options, tuple) and not options:
        return {}
    defaults = type(options)._field_defaults
    translated: dict[str, Any] = {}
    if options.enable_message_ordering:
        translated["enable_message_ordering"] = True
    if options.flow_control != defaults["flow_control"]:
        translated["flow_control"] = flow_control(options.flow_control)
    retry_given = options.retry is not defaults["retry"]
    timeout_given = options.timeout is not defaults["timeout"]
    if retry_given or timeout_given:
        translated["retry_settings"] = retry_settings(
            options.retry, options.timeout, retry_given, timeout_given
        )
    if getattr(options, "enable_open_telemetry_tracing", False):
        translated["enable_open_telemetry"] = True
    return translated


def translate(
    arguments: dict[str, Any], publisher_options_value: Any, client_options_value: Any
) -> dict[str, Any]:
    """hedgepub's constructor ``arguments`` with the official ones folded in.

    ``arguments`` holds hedgepub's own keyword arguments as given (their defaults where not given), with
    ``batch_settings`` possibly the official ``BatchSettings``. A setting given both ways is refused.
    """
    arguments = dict(arguments)
    defaults = dict(arguments.pop("_defaults"))
    official_batch = arguments["batch_settings"]
    if is_official_batch_settings(official_batch) or (
        isinstance(official_batch, tuple) and not official_batch
    ):
        arguments["batch_settings"] = batch_settings(official_batch)
    translated: dict[str, Any] = {}
    if publisher_options_value is not None:
        if not (is_official_publisher_options(publisher_options_value) or publisher_options_value == ()):
            raise TypeError(
                "publisher_options (the second positional argument, as in the official client) must be a "
                "google.cloud.pubsub_v1.types.PublisherOptions; got "
                f"{type(publisher_options_value).__name__}: pass hedgepub's own settings by name"
            )
        translated.update(publisher_options(publisher_options_value))
    if client_options_value is not None:
        translated.update(client_options(client_options_value))
    for name, value in translated.items():
        if arguments[name] is not defaults[name] and arguments[name] != defaults[name]:
            source = "client_options" if name in ("endpoint", "credentials") else "publisher_options"
            raise ValueError(f"{name} given both directly and through {source}: give it once")
        arguments[name] = value
    return arguments
