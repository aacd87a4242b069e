"""Exceptions the worker client raises: one hierarchy, one translation table.

gRPC errors are translated at the boundary (:func:`translate_rpc_error`)
from the status code and the server's machine-readable reason; the
original ``grpc.RpcError`` is kept as ``__cause__`` for debugging but never
escapes to training code.
"""

from __future__ import annotations

import enum

import grpc

from wehub_ps.errors import REASON_METADATA_KEY, Reason
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY

__all__ = [
    "PSError",
    "InvalidArgumentError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "VariableNotFoundError",
    "VariableConflictError",
    "ClusterMismatchError",
    "FailedPreconditionError",
    "NotInitializedError",
    "OverlapRefusedError",
    "ResourceExhaustedError",
    "PushWrittenOffError",
    "ServerBusyError",
    "PSUnavailableError",
    "NotPrimaryError",
    "AuthenticationError",
    "PSTLSError",
    "TLSProblem",
    "PSInternalError",
    "translate_rpc_error",
    "error_for",
]


class PSError(Exception):
    """Base of every error the client raises for a failed request.

    ``address`` names the ps-server involved (None when the error arose in
    the client), ``reason`` the server's reason code when it sent one.
    """

    def __init__(self, message: str, *, address: str | None = None,
                 reason: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.reason = reason
        self.code = code


class InvalidArgumentError(PSError, ValueError):
    """The request was malformed or inconsistent with the variable."""


class ShapeMismatchError(InvalidArgumentError):
    """An array's shape differs from the variable's."""


class DTypeMismatchError(InvalidArgumentError):
    """An array's dtype differs from the variable's."""


class VariableNotFoundError(PSError, LookupError):
    """No variable of that name exists in the cluster."""


class VariableConflictError(PSError):
    """A variable of that name exists with a different spec."""


class FailedPreconditionError(PSError):
    """The cluster is not in a state that allows the request."""


class ClusterMismatchError(FailedPreconditionError):
    """The servers disagree with the client's address list (order or length)."""


class NotInitializedError(FailedPreconditionError):
    """The variable's explicit initial value has not been uploaded yet."""


class OverlapRefusedError(FailedPreconditionError):
    """``push(wait=False)`` or ``step(overlap=True)`` against servers whose consistency mode forbids it.

    Under ``ssp`` and ``sync`` a step's pull must see this worker's previous
    push (the staleness bound and the step barrier count on it); a push in
    the background would break that, so these calls are refused before
    anything is sent.
    """


class ResourceExhaustedError(PSError):
    """A server limit (memory, message size, concurrent requests) was hit."""


class PushWrittenOffError(PSError):
    """A retried push that the server's ledger had given up on (ABORTED, PUSH_WRITTEN_OFF).

    The server keeps a bounded number of unfinished pushes per worker
    process; past that it writes the oldest off. Such a push may be partly
    applied: the chunks that reached the server before stay applied, the
    rest never will be. It is not retried (that could apply a part twice):
    pull the current values and continue with a fresh gradient. Seeing it
    means this worker had very many pushes to one server unfinished at once
    (threads pushing concurrently, or a long outage).
    """


class PSUnavailableError(PSError):
    """A ps-server could not be reached in time, or is shutting down."""


class NotPrimaryError(PSUnavailableError):
    """The server is a backup replica of its shard (or a deposed primary): only the primary serves.

    ``primary`` is the address ('host:port') of the shard's primary as that
    replica knows it, or None when it knows none (an election is under way).
    The client follows it to the primary and retries, like any unavailability.
    """

    def __init__(self, message: str, *, address: str | None = None, reason: str | None = None,
                 code: str | None = None, primary: str | None = None) -> None:
        super().__init__(message, address=address, reason=reason, code=code)
        self.primary = primary


class ServerBusyError(ResourceExhaustedError, PSUnavailableError):
    """The server serves as many calls at once as it may (``--max-concurrent-rpcs``).

    Nothing was done; like unavailability it is retried until ``retry_timeout``.
    """


class AuthenticationError(PSError):
    """The server wants a bearer token, or a different one (UNAUTHENTICATED)."""


class TLSProblem(str, enum.Enum):
    """What a TLS handshake check found wrong between the client's settings and a ps-server."""

    SERVER_USES_TLS = "SERVER_USES_TLS"  # a plaintext client, a server with --tls-cert
    SERVER_PLAINTEXT = "SERVER_PLAINTEXT"  # a TLS client, a server without --tls-cert
    SERVER_CERTIFICATE_UNTRUSTED = "SERVER_CERTIFICATE_UNTRUSTED"  # not signed by tls_ca, expired, ...
    SERVER_NAME_MISMATCH = "SERVER_NAME_MISMATCH"  # the certificate is not for the address / server_name
    CLIENT_CERTIFICATE_REQUIRED = "CLIENT_CERTIFICATE_REQUIRED"  # mutual TLS, no tls_cert given
    CLIENT_CERTIFICATE_REFUSED = "CLIENT_CERTIFICATE_REFUSED"  # mutual TLS, tls_cert not from its client CA
    HANDSHAKE_REFUSED = "HANDSHAKE_REFUSED"  # the server answered the handshake with a TLS alert


class PSTLSError(PSError):
    """The client's TLS settings and a ps-server's do not fit; retrying cannot help.

    ``problem`` (a :class:`TLSProblem`, also in ``reason``) says which side
    to fix; the message says how. Raised when connecting, in place of the
    unavailability a failed handshake looks like to gRPC.
    """

    def __init__(self, message: str, *, address: str | None = None, reason: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, address=address, reason=reason, code=code)
        self.problem = TLSProblem(reason)


class PSInternalError(PSError):
    """A server bug or an unexpected status; the message has the details."""


_BY_REASON: dict[str, type[PSError]] = {
    Reason.SHAPE_MISMATCH.value: ShapeMismatchError,
    Reason.DTYPE_MISMATCH.value: DTypeMismatchError,
    Reason.UNKNOWN_VARIABLE.value: VariableNotFoundError,
    Reason.SPEC_CONFLICT.value: VariableConflictError,
    Reason.CLUSTER_MISMATCH.value: ClusterMismatchError,
    Reason.NOT_INITIALIZED.value: NotInitializedError,
    Reason.PUSH_WRITTEN_OFF.value: PushWrittenOffError,
    Reason.TOO_MANY_RPCS.value: ServerBusyError,
}

_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: VariableNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: VariableConflictError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: PSUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: PSUnavailableError,
    grpc.StatusCode.CANCELLED: PSUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
}


def _trailer(error: grpc.RpcError, name: str) -> str | None:
    """The value of trailing metadata ``name`` of a failed call, if it has one."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # not a Call (e.g. raised before the call started)
        return None
    for key, value in metadata:
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return None


def translate_rpc_error(error: grpc.RpcError, address: str, what: str) -> PSError:
    """The typed exception for a failed RPC; ``what`` says what was attempted."""
    try:
        code = error.code()
        details = error.details() or ""
    except Exception:
        code, details = grpc.StatusCode.UNKNOWN, str(error)
    reason = _trailer(error, REASON_METADATA_KEY)
    primary = _trailer(error, PRIMARY_METADATA_KEY) if reason == Reason.NOT_PRIMARY.value else None
    return error_for(code, reason, details, address, what, primary)


def error_for(code: grpc.StatusCode, reason: str | None, details: str, address: str, what: str,
              primary: str | None = None) -> PSError:
    """The typed exception for a status code and the server's reason (the one table).

    ``primary``: with reason NOT_PRIMARY, the primary the refusing replica named.
    """
    if reason == Reason.NOT_PRIMARY.value:
        # Only what the refusal carries is added, once; the server's details say what it knows.
        names = f" (the primary is {primary})" if primary and primary not in details else ""
        return NotPrimaryError(f"{what}: ps-server {address} is not the primary of its shard{names}: "
                               f"{details}", address=address, reason=reason, code=code.name,
                               primary=primary or None)
    cls = _BY_REASON.get(reason or "") or _BY_CODE.get(code, PSInternalError)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"{what}: ps-server {address} is unavailable ({code.name}: {details})"
    else:
        message = f"{what} on ps-server {address}: {details}"
    return cls(message, address=address, reason=reason, code=code.name)
