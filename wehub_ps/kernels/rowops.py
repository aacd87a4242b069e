"""Gathering and scattering whole rows of a 2-D array, at memory speed.

Sparse pulls and pushes read and write a few thousand random rows of a
table of millions. NumPy's fancy indexing (``table[rows]``, ``table[rows]
= values``) walks them through its generic index iterator; ``np.take``
along axis 0, and ``np.put`` on a view of each row as one opaque record,
copy row by row. Measured on 2,048 random rows of 64 float32 from a 1.28 GB
table on this machine: gather 0.29-0.32 -> 0.10-0.12 ms, scatter 0.28-0.29
-> 0.11-0.13 ms. The results are the same bytes.

A :class:`RowGather` names rows to gather later, so a table's rows can be
handed to whoever frames a message and copied once, straight into it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

__all__ = ["RowGather", "take_rows", "take_rows_into", "put_rows"]


def take_rows(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``table[rows]`` (a copy) for a ``table`` of rows along axis 0."""
    return np.take(table, rows, axis=0)


def take_rows_into(out: np.ndarray, table: np.ndarray, rows: np.ndarray) -> None:
    """``table[rows]``'s bytes into ``out`` (uint8, any alignment) for a C-contiguous 2-D ``table``.

    ``rows`` must be valid (they are not checked). Each row is one opaque
    record, aligned at any address, so NumPy writes straight into ``out``
    (a message being built) instead of through a buffer.
    """
    if not table.shape[1] or not len(rows):
        return
    record = np.dtype((np.void, table.shape[1] * table.dtype.itemsize))
    np.take(table.view(record).reshape(-1), rows, out=out.view(record), mode="clip")


def put_rows(table: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``table[rows] = values`` for a C-contiguous 2-D ``table``; ``values`` is cast to its dtype.

    A repeated row gets the last of its values, as with fancy indexing.
    """
    if values.dtype != table.dtype or not values.flags.c_contiguous:
        values = np.ascontiguousarray(values, dtype=table.dtype)
    if not table.flags.c_contiguous or table.ndim != 2 or table.shape[1] == 0 or len(rows) == 0:
        table[rows] = values  # not viewable as one record per row (or nothing to put)
        return
    record = np.dtype((np.void, table.shape[1] * table.dtype.itemsize))
    np.put(table.view(record).reshape(-1), rows, values.reshape(len(rows), -1).view(record).reshape(-1))


@dataclass(frozen=True, slots=True)
class RowGather:
    """Rows ``rows`` of the C-contiguous 2-D ``source``, to be gathered into a message as it is joined.

    ``rows`` must all be valid row indices of ``source`` (the caller made
    them: they are not checked again). ``lock``, when given, is held while
    the rows are read (a table that others update).
    """

    source: np.ndarray
    rows: np.ndarray
    lock: AbstractContextManager | None = None

    @property
    def size(self) -> int:
        """Elements."""
        return len(self.rows) * self.source.shape[1]

    @property
    def nbytes(self) -> int:
        return self.size * self.source.itemsize

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype

    def select(self, positions: slice | np.ndarray) -> RowGather:
        """The gather of ``self.rows[positions]``."""
        return RowGather(self.source, self.rows[positions], self.lock)

    def gather(self) -> np.ndarray:
        """The rows as a new 2-D array."""
        with self.lock or nullcontext():
            return take_rows(self.source, self.rows)

    def write_into(self, dest: np.ndarray) -> None:
        """Gather the rows into ``dest``, ``nbytes`` bytes of uint8 at any alignment."""
        with self.lock or nullcontext():
            take_rows_into(dest, self.source, self.rows)
