"""Export subscriptions' configurations, checked as the real service checks them.

A subscription delivers one way: pull, push (``push_config.push_endpoint``), or export to Cloud Storage
(``cloud_storage_config``), BigQuery (``bigquery_config``) or Bigtable (``bigtable_config``). The fields
of each export are checked first (INVALID_ARGUMENT, naming the field); then BigQuery and Bigtable are
refused (UNIMPLEMENTED: this server has no table to write to), and Cloud Storage is refused
(FAILED_PRECONDITION) unless the server has a directory standing for the buckets.
"""

from __future__ import annotations

import re
from typing import Any

from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits
from hedgepub.server._pubsub.limits import ServiceError, invalid

__all__ = [
    "DEFAULT_DATETIME_FORMAT",
    "DEFAULT_MAX_DURATION_SECONDS",
    "check_exports",
    "export_kind",
]

#: Cloud Storage batches: bounds of ``max_duration`` (seconds), ``max_bytes`` and ``max_messages``.
MIN_MAX_DURATION_SECONDS = 60
MAX_MAX_DURATION_SECONDS = 600
DEFAULT_MAX_DURATION_SECONDS = 300
MIN_MAX_BYTES = 1000
MAX_MAX_BYTES = 10 * 1024**3
MIN_MAX_MESSAGES = 1000
#: Datetime part of a file name when ``filename_datetime_format`` is empty.
DEFAULT_DATETIME_FORMAT = "YYYY-MM-DDThh:mm:ssZ"
#: What a ``filename_datetime_format`` may hold: the fields YYYY, MM, DD, hh, mm and ss, and separators
#: between them.
_DATETIME_FORMAT = re.compile(r"(?:YYYY|MM|DD|hh|mm|ss|[-_:/T Z+.])+")
#: Cloud Storage's bucket names: lowercase letters, digits, '-', '_' and '.', starting and ending with a
#: letter or digit; 3 to 63 characters, or up to 222 with dots, each dot-separated part 63 at most.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_BUCKET_PART = re.compile(r"[a-z0-9_-]{1,63}")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
#: "google" and its close misspellings (0 for o, 1 or i for l, a third o, "googel"), which bucket names
#: may not contain.
_GOOGLE = re.compile(r"g[o0]{2,3}g[l1i]e|g[o0]{2}gel")
#: Cloud Storage's longest object name, in bytes of UTF-8.
MAX_OBJECT_NAME_BYTES = 1024
#: What a file name adds to the prefix, the datetime and the suffix: '_' and a UUID of 32 hex digits.
UNIQUE_PART_BYTES = 33
#: The longest name of one folder or file on the file systems the buckets directory may be on.
MAX_PATH_PART_BYTES = 255
#: Object names Cloud Storage refuses to begin with.
_RESERVED_OBJECT_PREFIX = ".well-known/acme-challenge/"
_BIGQUERY_TABLE = re.compile(r"[A-Za-z0-9.:-]{1,128}\.[A-Za-z0-9_]{1,1024}\.[\w$-]{1,1024}", re.UNICODE)
_BIGTABLE_TABLE = re.compile(
    r"projects/[a-z0-9:.\-]{1,128}/instances/[a-z][a-z0-9\-]{4,31}[a-z0-9]/tables/[\w\-.]{1,50}"
)

_KINDS = ("bigquery_config", "cloud_storage_config", "bigtable_config")


def export_kind(config: Any) -> str | None:
    """Which export a subscription makes (``"cloud_storage_config"``, ...), or ``None``."""
    for kind in _KINDS:
        if config.HasField(kind) and getattr(config, kind).ByteSize():
            return kind
    return None


def check_exports(config: Any, buckets: bool) -> None:
    """Check a subscription's export (``buckets``: whether this server writes Cloud Storage files)."""
    given = [kind for kind in _KINDS if config.HasField(kind) and getattr(config, kind).ByteSize()]
    if config.push_config.push_endpoint:
        given.insert(0, "push_config")
    if len(given) > 1:
        raise invalid(f"A subscription delivers one way: {' and '.join(given)} cannot both be set.")
    for kind in _KINDS:  # an empty config message is no export at all
        if config.HasField(kind) and not getattr(config, kind).ByteSize():
            config.ClearField(kind)
    if not given or given[0] == "push_config":
        return
    kind = given[0]
    if kind == "cloud_storage_config":
        check_cloud_storage(config.cloud_storage_config)
        if not buckets:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                "Cloud Storage subscriptions need a directory standing for the buckets: start the server "
                "with --buckets-dir DIR (LocalServer(buckets_dir=...)).",
            )
        config.cloud_storage_config.state = 1  # ACTIVE
        return
    if kind == "bigquery_config":
        check_bigquery(config.bigquery_config)
        what = "BigQuery"
    else:
        check_bigtable(config.bigtable_config)
        what = "Bigtable"
    raise ServiceError(
        StatusCode.UNIMPLEMENTED,
        f"{what} subscriptions ({kind}) are not supported by this server, which has no {what} table to "
        "write to; use a Cloud Storage subscription (--buckets-dir) or a pull subscription.",
    )


def check_bucket(bucket: str) -> None:
    """A bucket's name, by Cloud Storage's naming rules (INVALID_ARGUMENT naming the rule it breaks)."""
    if not bucket:
        raise invalid("Invalid cloud_storage_config: bucket is required.")

    def refuse(why: str) -> ServiceError:
        return invalid(f"Invalid cloud_storage_config.bucket ({bucket}): {why}")

    if "://" in bucket:
        raise refuse("give the bucket's name alone, without a prefix such as gs://.")
    parts = bucket.split(".")
    if (
        not _BUCKET.fullmatch(bucket)
        or not all(_BUCKET_PART.fullmatch(part) for part in parts)
        or (len(parts) == 1 and len(bucket) > 63)
    ):
        raise refuse(
            "bucket names are 3 to 63 lowercase letters, digits, dashes, underscores and dots (up to 222 "
            "with dots, each dot-separated part 63 at most), starting and ending with a letter or digit."
        )
    if _IPV4.fullmatch(bucket):
        raise refuse("a bucket name cannot be an IP address in dotted-decimal notation.")
    if bucket.startswith("goog"):
        raise refuse("a bucket name cannot begin with 'goog'.")
    if _GOOGLE.search(bucket):
        raise refuse("a bucket name cannot contain 'google' or a close misspelling of it.")


def check_file_names(storage: Any) -> None:
    """The parts of a ``CloudStorageConfig``'s file names: each a valid object name part, and the names
    they make within Cloud Storage's 1,024 bytes and the file system's 255 bytes per folder or file."""
    for field in ("filename_prefix", "filename_suffix", "filename_datetime_format"):
        value = getattr(storage, field)
        if any(character in value for character in "\r\n\0"):
            raise invalid(f"Invalid cloud_storage_config.{field} ({value!r}): not a valid object name part.")
        # The bucket is a folder here: no part of a file's name may climb out of it.
        if any(part in ("..", ".") for part in value.split("/")) or value.startswith("/"):
            raise invalid(
                f"Invalid cloud_storage_config.{field} ({value!r}): '.' and '..' are not allowed as "
                "folder names, nor a leading '/'."
            )
    if storage.filename_suffix.endswith("/"):
        raise invalid(
            f"Invalid cloud_storage_config.filename_suffix ({storage.filename_suffix}): it must not end "
            "in '/'."
        )
    prefix = storage.filename_prefix
    if prefix.startswith(_RESERVED_OBJECT_PREFIX):
        raise invalid(
            f"Invalid cloud_storage_config.filename_prefix ({prefix!r}): object names cannot begin with "
            f"{_RESERVED_OBJECT_PREFIX}."
        )
    # A datetime field is as long as its digits (YYYY: 4, the others: 2): the format's length is the
    # datetime's. What a name looks like, with the unique part as long as it will be:
    shape = (
        f"{prefix}{storage.filename_datetime_format or DEFAULT_DATETIME_FORMAT}_{'0' * 32}"
        f"{storage.filename_suffix}"
    ).encode()
    if len(shape) > MAX_OBJECT_NAME_BYTES:
        raise invalid(
            f"Invalid cloud_storage_config: its file names would be {len(shape)} bytes, over Cloud "
            f"Storage's {MAX_OBJECT_NAME_BYTES} bytes for an object name (filename_prefix, the datetime in "
            f"filename_datetime_format and filename_suffix, with the {UNIQUE_PART_BYTES} bytes of '_' and a "
            "UUID between them)."
        )
    longest = max(len(part) for part in shape.split(b"/"))
    if longest > MAX_PATH_PART_BYTES:
        raise invalid(
            f"Invalid cloud_storage_config: a folder or file of its file names would be {longest} bytes "
            f"between two '/', over the {MAX_PATH_PART_BYTES} bytes a file system allows for one name (this "
            "server writes buckets as folders: put a '/' in filename_prefix to split it)."
        )


def check_cloud_storage(storage: Any) -> None:
    """A ``CloudStorageConfig``: bucket, file names, batch bounds; defaults filled in."""
    check_bucket(storage.bucket)
    datetime_format = storage.filename_datetime_format
    if datetime_format and not _DATETIME_FORMAT.fullmatch(datetime_format):
        raise invalid(
            f"Invalid cloud_storage_config.filename_datetime_format ({datetime_format}): use YYYY, MM, "
            "DD, hh, mm and ss, separated by '-', '_', ':', '/', 'T', 'Z', '+', '.' or spaces."
        )
    check_file_names(storage)
    if storage.HasField("max_duration"):
        duration = limits.seconds(storage.max_duration)
        if not MIN_MAX_DURATION_SECONDS <= duration <= MAX_MAX_DURATION_SECONDS:
            raise invalid(
                f"Invalid cloud_storage_config.max_duration given: {duration:g}s. It must be between 1 "
                "minute and 10 minutes."
            )
    else:
        storage.max_duration.seconds = DEFAULT_MAX_DURATION_SECONDS
    if storage.max_bytes and not MIN_MAX_BYTES <= storage.max_bytes <= MAX_MAX_BYTES:
        raise invalid(
            f"Invalid cloud_storage_config.max_bytes given: {storage.max_bytes}. It must be between "
            f"{MIN_MAX_BYTES} (1 KB) and {MAX_MAX_BYTES} (10 GiB)."
        )
    if storage.max_messages and storage.max_messages < MIN_MAX_MESSAGES:
        raise invalid(
            f"Invalid cloud_storage_config.max_messages given: {storage.max_messages}. It must be at "
            f"least {MIN_MAX_MESSAGES}."
        )
    if storage.max_bytes < 0 or storage.max_messages < 0:
        raise invalid("Invalid cloud_storage_config: max_bytes and max_messages must not be negative.")


def check_bigquery(bigquery: Any) -> None:
    """A ``BigQueryConfig``: the table's name, and schema options that exclude each other."""
    table = bigquery.table
    if not table or not _BIGQUERY_TABLE.fullmatch(table):
        raise invalid(
            f"Invalid bigquery_config.table ({table!r}): it must be of the form "
            "{projectId}.{datasetId}.{tableId}."
        )
    if bigquery.use_topic_schema and bigquery.use_table_schema:
        raise invalid("Invalid bigquery_config: use_topic_schema and use_table_schema cannot both be true.")


def check_bigtable(bigtable: Any) -> None:
    """A ``BigtableConfig``: the table's full name."""
    table = bigtable.table
    if not table or not _BIGTABLE_TABLE.fullmatch(table):
        raise invalid(
            f"Invalid bigtable_config.table ({table!r}): it must be of the form "
            "projects/{project}/instances/{instance}/tables/{table}."
        )
