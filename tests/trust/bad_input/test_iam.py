"""Bad input to the IAM policy RPCs over raw gRPC."""

from __future__ import annotations

from typing import Any

from google.iam.v1 import iam_policy_pb2, options_pb2
from hypothesis import given
from hypothesis import strategies as st

from ._common import (
    CASES,
    Client,
    _iam_resources,
    _masks,
    _permissions,
    _policies,
    check_answer,
    examples,
)


@examples(120)
@given(
    case=st.one_of(
        st.tuples(
            st.just("SetIamPolicy"),
            st.builds(
                lambda resource, policy, mask: iam_policy_pb2.SetIamPolicyRequest(
                    resource=resource, policy=policy, update_mask=mask
                ),
                _iam_resources,
                _policies,
                _masks,
            ),
        ),
        st.tuples(
            st.just("GetIamPolicy"),
            st.builds(
                lambda resource, version: iam_policy_pb2.GetIamPolicyRequest(
                    resource=resource, options=options_pb2.GetPolicyOptions(requested_policy_version=version)
                ),
                _iam_resources,
                st.sampled_from([-1, 0, 1, 3, 4]),
            ),
        ),
        st.tuples(
            st.just("TestIamPermissions"),
            st.builds(
                lambda resource, permissions: iam_policy_pb2.TestIamPermissionsRequest(
                    resource=resource, permissions=permissions
                ),
                _iam_resources,
                _permissions,
            ),
        ),
    )
)
def test_iam(client: Client, case: tuple[str, Any]) -> None:
    method, request = case
    CASES[method] += 1
    code, details, _ = client.call(method, request)
    check_answer(client, method, code, details)
