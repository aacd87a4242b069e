"""Row ids in requests: parsing and checking that they belong to this shard."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason
from wehub_ps.kernels.rowops import RowGather
from wehub_ps.placement import hash_shards

__all__ = ["parse_row_ids", "ParsedRows", "MAX_ROWS_PER_REQUEST", "unique_ids", "gathered_bytes",
           "rows_in_order"]

# One request names at most this many rows: 8 MiB of ids, and a bound on the
# gathered block a single pull or push can make the server build.
MAX_ROWS_PER_REQUEST = 1 << 20


class ParsedRows(NamedTuple):
    """A request's row ids, checked."""

    #: The ids as sent (global row indices, or a hash table's keys).
    ids: np.ndarray
    #: A dense part's rows as indices into its local block (the range check's
    #: result, kept so no later step computes it again); None for a hash table.
    local: np.ndarray | None


def parse_row_ids(part, raw: bytes, shard_index: int, num_shards: int, *, unique: bool) -> ParsedRows:
    """The int64 ids of a request, checked against this shard; nothing is changed on error.

    Dense variables take global row indices inside this shard's rows; hash
    tables take any 64-bit id whose hash places it on this shard. Pushes
    require unique ids (the client sums repeated ones before sending).
    """
    name = part.spec.name
    if len(raw) % 8:
        raise RequestError(Reason.INVALID_CHUNK, f"row_ids of {name!r} must be little-endian int64 "
                                                 f"(a multiple of 8 bytes), got {len(raw)} bytes")
    ids = np.frombuffer(raw, dtype="<i8")
    if len(ids) > MAX_ROWS_PER_REQUEST:
        raise RequestError(Reason.MEMORY_LIMIT, f"{len(ids)} rows of {name!r} in one request; at most "
                                                f"{MAX_ROWS_PER_REQUEST} (split the request)")
    # The client sends sorted ids (one comparison per id suffices then); others are sorted here.
    if unique and not (ids[1:] > ids[:-1]).all() and len(np.unique(ids)) != len(ids):
        raise RequestError(Reason.INVALID_CHUNK, f"row_ids of {name!r} repeat an id; sum their gradients first")
    if part.spec.hash_table:
        wrong = hash_shards(ids, num_shards) != shard_index
        if wrong.any():
            raise RequestError(Reason.CLUSTER_MISMATCH,
                               f"row id {int(ids[wrong][0])} of {name!r} belongs to shard "
                               f"{int(hash_shards(ids[wrong][:1], num_shards)[0])}, not {shard_index}")
        return ParsedRows(ids, None)
    if not part.holds_part:
        raise RequestError(Reason.INVALID_REQUEST, f"variable {name!r} has no rows on shard {shard_index}")
    return ParsedRows(ids, part.local_rows(ids))  # raises when a row is outside this shard's range


def unique_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The ids to read, each once, and where each requested id is among them (None: as requested).

    A pull may name an id many times; the rows are read (and held) once per
    id, and the answer repeats them as it is joined, so the server never
    holds a copy per repetition.
    """
    if len(ids) < 2 or (ids[1:] > ids[:-1]).all():  # sorted, no repeats: what PSClient sends
        return ids, None
    unique, inverse = np.unique(ids, return_inverse=True)
    if len(unique) == len(ids):
        return ids, None
    return unique, inverse.reshape(-1)


def gathered_bytes(part, rows: int, inverse: np.ndarray | None, wire: np.dtype) -> int:
    """Bytes that reading ``rows`` rows of ``part`` for a pull allocates (see :func:`rows_in_order`)."""
    elements = rows * part.spec.row_elements
    converted = elements * wire.itemsize if inverse is not None and wire != part.spec.dtype else 0
    return elements * part.spec.dtype.itemsize + converted


def rows_in_order(values: np.ndarray, inverse: np.ndarray | None,
                  wire: np.dtype) -> np.ndarray | RowGather:
    """Rows read once per id, answered in the requested order (repeats gathered as the message is joined)."""
    if inverse is None:
        return values
    if wire != values.dtype:
        values = values.astype(wire)
    return RowGather(values, inverse)
