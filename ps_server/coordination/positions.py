"""Where a replica's state stands in its shard's history, and the rules that compare positions.

Every change a primary makes is numbered in its term's log: ``epoch`` (the
term; the etcd revision that created its leader key, so a later term has a
larger one) and ``sequence``. A new primary's log goes on from the sequence
of the state it was elected with (or starts at 0 after a restore from disk);
its records carry its own epoch. A replica's state is at a
:class:`Position`: the epoch of the term whose log it holds and the newest
sequence of that log applied.

The rules, each checked in one place (docs/failure-semantics.md states them):

1. **Log matching** (:func:`continues`): a backup applies a record only when
   it continues the log it holds: the same epoch as the snapshot it installed
   on this stream, and the next sequence. Anything else ends the stream (the
   backup then starts over from a new snapshot).
2. **Answers that count** (:func:`acknowledges`): a backup's answer
   acknowledges changes only when it names the primary's own term, which a
   backup does only after it installed that term's snapshot on the stream.
   An answer from another term, or sent before the snapshot was installed,
   proves the backup alive and nothing more.
3. **Freshness** (:func:`fresher`): of two states, the one at the larger
   (epoch, sequence) is newer: a later term's state replaces any earlier
   term's (the term started from a state holding every acknowledged change),
   and within one term a longer prefix of the same log holds more.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NO_STATE", "Position", "acknowledges", "continues", "fresher"]


@dataclass(frozen=True, order=True)
class Position:
    """(epoch, sequence): the newest change of term ``epoch``'s log that a state holds."""

    epoch: int
    sequence: int

    def __str__(self) -> str:
        return f"{self.epoch}/{self.sequence}"


#: The position of a replica holding nothing it followed (empty, or only a checkpoint it restored).
NO_STATE = Position(0, 0)


def continues(held: Position, record_epoch: int, record_sequence: int) -> bool:
    """Rule 1: whether a record of term ``record_epoch`` numbered ``record_sequence`` extends ``held``."""
    return held.epoch != 0 and record_epoch == held.epoch and record_sequence == held.sequence + 1


def acknowledges(term_epoch: int, answer_epoch: int) -> bool:
    """Rule 2: whether an answer naming ``answer_epoch`` acknowledges changes of term ``term_epoch``."""
    return term_epoch != 0 and answer_epoch == term_epoch


def fresher(a: Position, b: Position) -> bool:
    """Rule 3: whether a state at ``a`` is strictly newer than one at ``b``."""
    return a > b
