"""Machine-readable error reasons shared by server and client.

The server attaches the reason to every error status as trailing metadata
under :data:`REASON_METADATA_KEY`; the client picks the exception class from
it. Neither side ever classifies an error by its message text.
"""

from __future__ import annotations

import enum

__all__ = ["Reason", "REASON_METADATA_KEY"]

REASON_METADATA_KEY = "wehub-ps-reason"


class Reason(str, enum.Enum):
    """Why a request failed. The gRPC status code is derived from it."""

    MALFORMED_MESSAGE = "MALFORMED_MESSAGE"  # not a valid protobuf message
    INVALID_SPEC = "INVALID_SPEC"  # bad name, shape, dtype, optimizer ...
    INVALID_CHUNK = "INVALID_CHUNK"  # offset/count/bytes out of range
    INVALID_REQUEST = "INVALID_REQUEST"  # well-formed but inconsistent request
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    DTYPE_MISMATCH = "DTYPE_MISMATCH"
    UNKNOWN_VARIABLE = "UNKNOWN_VARIABLE"
    SPEC_CONFLICT = "SPEC_CONFLICT"  # same name, different spec
    CLUSTER_MISMATCH = "CLUSTER_MISMATCH"  # caller's shard index/count differ
    NOT_INITIALIZED = "NOT_INITIALIZED"  # explicit initial value not uploaded
    PUSH_INCOMPLETE = "PUSH_INCOMPLETE"  # stream ended before all chunks came
    MEMORY_LIMIT = "MEMORY_LIMIT"  # would exceed the server's memory budget
    SHUTTING_DOWN = "SHUTTING_DOWN"  # server is starting up or draining after SIGTERM
    CHECKPOINTS_DISABLED = "CHECKPOINTS_DISABLED"  # no --checkpoint-dir
    DISK_TIER_DISABLED = "DISK_TIER_DISABLED"  # a table with a disk tier on a server without --disk-tier-dir
    STEP_TIMEOUT = "STEP_TIMEOUT"  # ssp/sync: a pull waited its whole deadline for other workers
    FINISH_NOT_ALLOWED = "FINISH_NOT_ALLOWED"  # finish() on a server without --allow-finish
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no or a wrong bearer token (set by the auth interceptor)
    PUSH_WRITTEN_OFF = "PUSH_WRITTEN_OFF"  # a retried push the ledger gave up on: it may be partly applied
    TOO_MANY_RPCS = "TOO_MANY_RPCS"  # --max-concurrent-rpcs ordinary calls are in progress
    EXCHANGE_STREAMS = "EXCHANGE_STREAMS"  # --max-exchange-streams (or one incarnation's share) are open
    NOT_PRIMARY = "NOT_PRIMARY"  # a backup (or a deposed primary): PRIMARY_METADATA_KEY names the primary
    SWITCHOVER_REFUSED = "SWITCHOVER_REFUSED"  # no in-sync backup to hand over to, or it did not confirm in time
