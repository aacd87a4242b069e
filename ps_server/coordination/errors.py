"""The one error type of the coordination layer."""

from __future__ import annotations

__all__ = ["CoordinationError"]


class CoordinationError(RuntimeError):
    """etcd could not be reached, or it refused a request.

    ``unreachable`` tells the two apart: True when no endpoint answered (the
    caller may wait and retry), False when etcd answered with an error (a
    retry gives the same answer; the message says what to fix). ``code``:
    the gRPC status name etcd answered with, when it answered.
    """

    def __init__(self, message: str, *, unreachable: bool, code: str | None = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.code = code
