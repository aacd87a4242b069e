"""The one exception type the store raises for a bad request."""

from __future__ import annotations

from wehub_ps.errors import Reason

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the server refuses; nothing was changed.

    The service layer turns ``reason`` into a gRPC status code (one table,
    in :mod:`ps_server.service.servicer`) and sends ``message`` as the details.
    """

    def __init__(self, reason: Reason, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        #: Further trailing metadata of the refusal (NOT_PRIMARY: the primary's address).
        self.trailers = trailers
