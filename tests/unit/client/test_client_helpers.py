"""Pure helpers of the worker client: error translation and host/device arrays."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.errors import REASON_METADATA_KEY, Reason
from worker_client.arrays import parse_device, to_device, to_host
from worker_client.errors import (
    AuthenticationError,
    ClusterMismatchError,
    DTypeMismatchError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotInitializedError,
    PSError,
    PSInternalError,
    PSUnavailableError,
    ResourceExhaustedError,
    ShapeMismatchError,
    VariableConflictError,
    VariableNotFoundError,
    translate_rpc_error,
)
from worker_client.transport.credentials import BearerToken


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details="", reason=None, metadata_error=False):
        self._code, self._details = code, details
        self._reason, self._metadata_error = reason, metadata_error

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        if self._metadata_error:
            raise RuntimeError("no call")
        if self._reason is None:
            return (("other-key", "x"),)
        return (("other-key", "x"), (REASON_METADATA_KEY, self._reason))


@pytest.mark.parametrize("reason, cls", [
    (Reason.SHAPE_MISMATCH.value, ShapeMismatchError),
    (Reason.DTYPE_MISMATCH.value, DTypeMismatchError),
    (Reason.UNKNOWN_VARIABLE.value, VariableNotFoundError),
    (Reason.SPEC_CONFLICT.value, VariableConflictError),
    (Reason.CLUSTER_MISMATCH.value, ClusterMismatchError),
    (Reason.NOT_INITIALIZED.value, NotInitializedError),
    (Reason.NOT_INITIALIZED.value.encode(), NotInitializedError),  # bytes metadata
])
def test_reason_picks_the_class(reason, cls):
    # The status code says something generic; the reason decides.
    error = translate_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", reason),
                                "h:1", "push")
    assert type(error) is cls
    assert error.address == "h:1"
    assert error.code == "INVALID_ARGUMENT"
    assert error.reason == (reason.decode() if isinstance(reason, bytes) else reason)
    assert "push" in str(error) and "h:1" in str(error) and "bad" in str(error)


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
    (grpc.StatusCode.OUT_OF_RANGE, InvalidArgumentError),
    (grpc.StatusCode.NOT_FOUND, VariableNotFoundError),
    (grpc.StatusCode.ALREADY_EXISTS, VariableConflictError),
    (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, PSUnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, PSUnavailableError),
    (grpc.StatusCode.CANCELLED, PSUnavailableError),
    (grpc.StatusCode.INTERNAL, PSInternalError),
    (grpc.StatusCode.UNKNOWN, PSInternalError),
    (grpc.StatusCode.PERMISSION_DENIED, AuthenticationError),
    (grpc.StatusCode.UNAUTHENTICATED, AuthenticationError),
])
def test_code_picks_the_class_without_a_known_reason(code, cls):
    for reason in (None, Reason.MEMORY_LIMIT.value, "SOMETHING_NEW"):
        error = translate_rpc_error(FakeRpcError(code, "details", reason), "h:2", "pull")
        assert type(error) is cls
        assert isinstance(error, PSError)
        assert error.code == code.name


def test_unavailable_message_says_so():
    error = translate_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "refused"), "h:3", "pull")
    assert "unavailable" in str(error) and "h:3" in str(error) and "refused" in str(error)


def test_error_without_call_metadata():
    error = translate_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", metadata_error=True),
                                "h:4", "describe")
    assert type(error) is VariableNotFoundError and error.reason is None


def test_exception_hierarchy_matches_builtin_expectations():
    assert issubclass(ShapeMismatchError, ValueError)
    assert issubclass(VariableNotFoundError, LookupError)
    assert issubclass(ClusterMismatchError, FailedPreconditionError)


# ---- arrays ---------------------------------------------------------------------------------


def test_to_host_keeps_numpy_arrays():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert to_host(a, "x") is a


def test_to_host_converts_lists_scalars_and_dlpack():
    np.testing.assert_array_equal(to_host([[1.0, 2.0]], "x"), np.array([[1.0, 2.0]]))
    assert to_host(3.5, "x").shape == ()
    assert to_host(np.float32(2), "x").dtype == np.float32

    class DLPackOnly:
        def __init__(self, array):
            self._array = array

        def __dlpack__(self, **kwargs):
            return self._array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    source = np.arange(5, dtype=np.float64)
    host = to_host(DLPackOnly(source), "x")
    np.testing.assert_array_equal(host, source)
    assert np.shares_memory(host, source)


class _DLPackBFloat16:
    """A DLPack producer holding bfloat16, which numpy's DLPack import cannot read (as JAX's are)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.dtype = "bfloat16"

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)  # numpy refuses bfloat16 here, as it does for JAX

    def __dlpack_device__(self):
        return (1, 0)


def test_to_host_reads_bfloat16_through_array_protocol():
    class WithArray(_DLPackBFloat16):
        def __array__(self, dtype=None, copy=None):
            return self._array

    source = np.arange(4, dtype=np.float32).astype(BFLOAT16)
    host = to_host(WithArray(source), "x")
    assert host.dtype == BFLOAT16 and np.shares_memory(host, source)


def test_to_host_names_a_dtype_numpy_cannot_read():
    with pytest.raises(DTypeMismatchError, match=r"gradients\['w'\].*bfloat16.*cast it"):
        to_host(_DLPackBFloat16(np.zeros(3, dtype=BFLOAT16)), "gradients['w']")


def test_to_host_refuses_other_objects():
    with pytest.raises(TypeError, match="gradients\\['w'\\]"):
        to_host({"a": 1}, "gradients['w']")


@pytest.mark.parametrize("device, expected", [
    (None, None), ("cpu", None), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), (2, 2),
])
def test_parse_device(device, expected):
    assert parse_device(device) == expected


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cuda:-1", True, 1.5, "CPU"])
def test_parse_device_refuses(device):
    with pytest.raises(ValueError, match="device"):
        parse_device(device)


def test_to_device_on_host_is_identity():
    a = np.ones(3)
    assert to_device(a, None) is a


def test_a_token_file_is_read_again_on_request(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    token = BearerToken(None, str(path))
    assert token.metadata() == (("authorization", "Bearer first"),)
    assert token.reread() is False  # unchanged
    path.write_text("")  # mid-rewrite: the last token read is kept
    assert token.reread() is False and token.metadata() == (("authorization", "Bearer first"),)
    path.write_text("second\n")
    assert token.reread() is True and token.metadata() == (("authorization", "Bearer second"),)
    fixed = BearerToken("given", None)
    assert fixed.reread() is False and not fixed.from_file
    assert BearerToken(None, None).metadata() is None
    with pytest.raises(ValueError, match="not both"):
        BearerToken("given", str(path))
