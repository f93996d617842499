"""IamConfig: tokens and policy files are checked at start, with errors that name the file and entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hedgepub.server import IamConfig, IamConfigError, LocalServer

TOKENS = {"t-alice": "user:alice@example.com", "t-ci": "serviceAccount:ci@p.iam.gserviceaccount.com"}
POLICY = {"bindings": [{"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]}]}


def _write(path: Path, content: object) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def test_from_files_reads_tokens_and_policy(tmp_path: Path) -> None:
    config = IamConfig.from_files(_write(tmp_path / "t.json", TOKENS), _write(tmp_path / "p.json", POLICY))
    assert config.tokens["t-alice"] == ("user:alice@example.com",)
    assert config.project_policy == {"roles/pubsub.admin": frozenset({"user:admin@example.com"})}
    assert IamConfig.from_files(tmp_path / "t.json").project_policy == {}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ([], "expected a JSON object from token to principal"),
        ({"t": "alice@example.com"}, "must be a string starting with user:, serviceAccount: or group:"),
        ({"t": "user:alice"}, "is not of the form kind:e-mail address"),
        ({"t": []}, "non-empty list of principals"),
        ({"t x": "user:a@example.com"}, "without spaces"),
    ],
)
def test_bad_tokens_files_are_refused(tmp_path: Path, content: object, fragment: str) -> None:
    path = _write(tmp_path / "tokens.json", content)
    with pytest.raises(IamConfigError, match=fragment) as error:
        IamConfig.from_files(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1,", "not valid JSON"),
        ({"bindings": {}}, "'bindings' must be a list"),
        (
            {"bindings": [{"role": "roles/pubsub.superuser", "members": []}]},
            "unknown role 'roles/pubsub.superuser'",
        ),
        (
            {"bindings": [{"role": "roles/viewer", "members": "user:a@example.com"}]},
            "'members' must be a list",
        ),
        ({"bindings": [{"role": "roles/viewer", "members": ["alice@example.com"]}]}, "unknown member"),
        ({"bindings": [{"role": "roles/viewer", "members": ["user:"]}]}, "unknown member"),
        (
            {
                "bindings": [
                    {"role": "roles/viewer", "members": ["allUsers"], "condition": {"expression": "true"}}
                ]
            },
            "conditional bindings are not supported",
        ),
        ({"policy": []}, "unknown field"),
    ],
)
def test_bad_policy_files_are_refused(tmp_path: Path, content: object, fragment: str) -> None:
    path = _write(tmp_path / "policy.json", content)
    with pytest.raises(IamConfigError, match=fragment) as error:
        IamConfig.from_files(_write(tmp_path / "tokens.json", TOKENS), path)
    assert str(path) in str(error.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(IamConfigError, match="cannot read the tokens file"):
        IamConfig.from_files(tmp_path / "absent.json")


def test_every_documented_member_kind_is_accepted() -> None:
    members = [
        "user:a@example.com",
        "serviceAccount:s@p.iam.gserviceaccount.com",
        "group:g@example.com",
        "domain:example.com",
        "allUsers",
        "allAuthenticatedUsers",
    ]
    config = IamConfig(TOKENS, {"bindings": [{"role": "roles/pubsub.viewer", "members": members}]})
    assert config.project_policy["roles/pubsub.viewer"] == frozenset(members)


def test_addresses_compare_without_case() -> None:
    config = IamConfig(
        {"t": "user:Alice@Example.COM"},
        {"bindings": [{"role": "roles/viewer", "members": ["user:ALICE@example.com"]}]},
    )
    assert config.tokens["t"] == ("user:alice@example.com",)
    assert config.project_policy["roles/viewer"] == frozenset({"user:alice@example.com"})


def test_iam_and_a_custom_authorizer_exclude_each_other() -> None:
    from hedgepub.server import AllowAll

    with pytest.raises(ValueError, match="not both"):
        LocalServer(in_memory=True, iam=IamConfig(TOKENS), authorizer=AllowAll())
    with pytest.raises(TypeError, match="IamConfig"):
        LocalServer(in_memory=True, iam=TOKENS)  # type: ignore[arg-type]
