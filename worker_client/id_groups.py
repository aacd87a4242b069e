"""The last batch of row ids grouped on each thread, kept for the next call on the same ids.

A training step pulls the rows of its batch's ids and then pushes their
gradients: ``pull_rows`` and ``push_rows`` group the same ids (their
sorted unique ids, and which one each id is). The second call then reuses
the first's grouping after one comparison of the ids (a few us).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from wehub_ps.kernels.groups import group_ids

__all__ = ["IdGroups", "grouped_ids"]

_last = threading.local()


@dataclass(frozen=True)
class IdGroups:
    """A batch's ids as ``unique`` (sorted) and ``inverse`` (``unique[inverse[i]] == ids[i]``); read-only arrays."""

    unique: np.ndarray
    inverse: np.ndarray

    @property
    def repeats(self) -> bool:
        """Whether some id occurs more than once."""
        return len(self.unique) < len(self.inverse)

    @cached_property
    def order(self) -> np.ndarray:
        """Where in the batch each unique id is; only where no id repeats."""
        if self.repeats:
            raise ValueError("ids repeat: an id has several places, use inverse")
        order = np.empty(len(self.inverse), np.int64)
        order[self.inverse] = np.arange(len(self.inverse))
        order.flags.writeable = False
        return order


def grouped_ids(ids: np.ndarray) -> IdGroups:
    """:func:`wehub_ps.kernels.groups.group_ids` of ``ids``, or this thread's last result for equal ids.

    The arrays are read-only: a caller must not change them, the next call may return them again.
    """
    cached = getattr(_last, "entry", None)
    if cached is not None:
        last_ids, groups = cached
        if len(last_ids) == len(ids) and np.array_equal(last_ids, ids):
            return groups
    unique, inverse = group_ids(ids)
    unique.flags.writeable = False
    inverse.flags.writeable = False
    groups = IdGroups(unique, inverse)
    _last.entry = (np.array(ids, copy=True), groups)
    return groups
