"""A primary's open push streams (records.OpenPushes): which a catch-up snapshot can carry, and the wait
for an instant without a staged one."""

from __future__ import annotations

import threading
import time

from ps_server.replication.records import OpenPushes
from wehub_ps.v1 import ps_pb2


def _begin(kind: int = ps_pb2.GRADIENT, worker: str = "w") -> ps_pb2.PushBegin:
    return ps_pb2.PushBegin(worker_id=worker, incarnation="i", sequence=1, kind=kind)


def test_a_stream_is_open_from_the_record_with_its_begin_to_its_last():
    pushes = OpenPushes()
    pushes.logged(1, None, False)  # a record before its begin was logged: not known yet
    assert pushes.resumable() == []
    pushes.logged(1, _begin(), False)
    pushes.logged(1, None, False)
    pushes.logged(2, _begin(worker="v"), False)
    assert [(p.stream, p.begin.worker_id) for p in pushes.resumable()] == [(1, "w"), (2, "v")]
    pushes.logged(1, None, True)
    pushes.logged(3, _begin(), True)  # begin and end in one record: never open
    assert [p.stream for p in pushes.resumable()] == [2]
    pushes.clear()
    assert pushes.resumable() == []


def test_assign_and_sync_pushes_are_staged_and_not_carried():
    pushes = OpenPushes()
    pushes.logged(1, _begin(ps_pb2.ASSIGN), False)
    pushes.logged(2, _begin(), False)
    assert pushes.staged()
    assert [p.stream for p in pushes.resumable()] == [2]
    pushes.logged(1, None, True)
    assert not pushes.staged()

    sync = OpenPushes(sync=True)
    sync.logged(5, _begin(), False)
    assert sync.staged() and sync.resumable() == []


def test_the_wait_ends_when_the_staged_stream_ends_or_at_its_bound():
    pushes = OpenPushes(sync=True)
    pushes.logged(1, _begin(), False)
    started = time.monotonic()
    pushes.wait_unstaged(0.2)
    assert time.monotonic() - started >= 0.2 and pushes.staged()

    ender = threading.Timer(0.1, pushes.logged, (1, None, True))
    ender.start()
    started = time.monotonic()
    pushes.wait_unstaged(30)
    assert not pushes.staged() and time.monotonic() - started < 30
    ender.join()
