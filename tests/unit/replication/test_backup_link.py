"""What a backup's answers count for on its primary's side (ps_server/replication/log.py)."""

from __future__ import annotations

import threading

import pytest

from ps_server.replication.log import BackupLink, UpdateLog


def _link(epoch: int) -> BackupLink:
    return BackupLink(1, 99, "h:1", 1 << 20, lambda: None, epoch)


def test_only_answers_naming_the_primarys_term_acknowledge():
    link = _link(epoch=7)
    for _ in range(4):
        link.sending(0)
    link.answered(0, 150)  # before its snapshot: alive, nothing held of this term
    link.answered(6, 150)  # a stale term's position, however large
    assert link.acknowledged == 0 and link.ignored_answers == 2
    assert link.proof > 0, "any answer proves the backup alive"
    link.answered(7, 120)
    assert link.acknowledged == 120
    link.answered(7, 110)  # answers come in order; never lower what was acknowledged
    assert link.acknowledged == 120


def test_a_new_terms_log_goes_on_from_the_state_it_was_elected_with():
    log = UpdateLog(41)
    link = _link(epoch=9)
    with log.ordered():
        assert log.attach(link) == 41
        assert log.append([b""], 1) == 42
    assert link.take(0.0)[0][0] == 42


def test_a_change_is_logged_only_in_the_shards_order():
    """Two appends outside the order could queue their sequences swapped (a backup would see a gap)."""
    log = UpdateLog(0)
    link = _link(epoch=1)
    with log.ordered():
        log.attach(link)
    with pytest.raises(RuntimeError, match="outside the shard's order"):
        log.append([b""], 1)
    assert log.sequence == 0 and link.take(0.0) == []


def test_wait_closed_returns_once_the_backup_ends_its_stream():
    """hand_over waits on it: the backup closes its stream once it took the term."""
    link = _link(epoch=3)
    assert link.wait_closed(0.01) is False
    threading.Timer(0.05, link.close, ("the backup's answers ended: it took the term",)).start()
    assert link.wait_closed(5.0) is True
    assert link.closed == "the backup's answers ended: it took the term"
