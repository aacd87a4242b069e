"""Exactly-once bookkeeping of pushes (ps_server.core.ledger)."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_server.core.errors import RequestError
from ps_server.core.ledger import RECORD_BYTES, SESSION_BYTES, ClaimResult, PushLedger, PushSession
from wehub_ps.errors import Reason


def _complete(ledger: PushLedger, worker: str, incarnation: str, sequence: int) -> None:
    session = ledger.begin(worker, incarnation, sequence, 4)
    assert session is not None
    assert session.claim("v", 0, 4) == ClaimResult.APPLY
    assert session.done("v", 0) is True
    ledger.finish(session)


# ---- the ledger ----------------------------------------------------------------------------


def test_new_push_gets_a_session():
    ledger = PushLedger()
    session = ledger.begin("w", "i", 1, 10)
    assert isinstance(session, PushSession)
    assert session.key == ("w", "i", 1)
    assert session.total_elements == 10
    assert session.steps == {}, "no optimizer step is reserved before a chunk lands"
    # A retry while it is still open rejoins the same session.
    again = ledger.begin("w", "i", 1, 10)
    assert again is session
    assert not ledger.is_done("w", "i", 1)


def test_step_is_reserved_once_per_variable():
    session = PushLedger().begin("w", "i", 1, 10)
    calls = []

    def reserve():
        calls.append(1)
        return 40 + len(calls)

    assert session.claim_with_step("v", 0, 2, reserve) == 41
    assert session.claim_with_step("v", 2, 2, reserve) == 41, "the variable's next chunk reuses the step"
    assert session.claim_with_step("u", 0, 2, reserve) == 42
    assert len(calls) == 2
    assert session.steps == {"v": 41, "u": 42}


def test_completed_push_is_a_duplicate():
    ledger = PushLedger()
    _complete(ledger, "w", "i", 1)
    assert ledger.is_done("w", "i", 1)
    assert ledger.begin("w", "i", 1, 4) is None
    # Same sequence from another incarnation or worker is a different push.
    assert not ledger.is_done("w", "other", 1)
    assert not ledger.is_done("x", "i", 1)
    assert ledger.begin("w", "other", 1, 4) is not None


def test_rejoin_with_a_different_size_is_refused():
    ledger = PushLedger()
    ledger.begin("w", "i", 1, 10)
    with pytest.raises(RequestError) as info:
        ledger.begin("w", "i", 1, 11)
    assert info.value.reason == Reason.INVALID_REQUEST
    assert "10" in info.value.message and "11" in info.value.message


def test_out_of_order_completion():
    ledger = PushLedger()
    for seq in (3, 5, 1):
        _complete(ledger, "w", "i", seq)
    assert [ledger.is_done("w", "i", s) for s in range(1, 7)] == [True, False, True, False, True, False]
    assert ledger.begin("w", "i", 2, 4) is not None
    assert ledger.begin("w", "i", 3, 4) is None
    _complete(ledger, "w", "i", 4)
    _complete(ledger, "w", "i", 2)
    assert all(ledger.is_done("w", "i", s) for s in range(1, 6))
    assert not ledger.is_done("w", "i", 6)
    state = ledger._states[("w", "i")]
    assert state.done_below == 6 and state.done_above == set()
    assert state.open == {}


@given(st.permutations(list(range(1, 30))))
@settings(max_examples=50, deadline=None)
def test_any_completion_order_ends_contiguous(order):
    ledger = PushLedger(max_done_window=100)
    done = set()
    for seq in order:
        _complete(ledger, "w", "i", seq)
        done.add(seq)
        for s in range(1, 32):
            assert ledger.is_done("w", "i", s) == (s in done)
    state = ledger._states[("w", "i")]
    assert state.done_below == 30 and not state.done_above


def test_done_window_is_bounded():
    ledger = PushLedger(max_done_window=3)
    # Push 1 never completes; 2..10 do.
    ledger.begin("w", "i", 1, 4)
    for seq in range(2, 11):
        _complete(ledger, "w", "i", seq)
        assert len(ledger._states[("w", "i")].done_above) <= 3
    # The ancient gap was given up: push 1 is written off, not done.
    _assert_written_off(ledger, 1)
    assert all(ledger.is_done("w", "i", s) for s in range(2, 11))
    assert not ledger.is_done("w", "i", 11)


def test_done_window_with_several_gaps():
    ledger = PushLedger(max_done_window=2)
    for seq in (2, 4, 6, 8, 10):
        _complete(ledger, "w", "i", seq)
        assert len(ledger._states[("w", "i")].done_above) <= 2
    for seq in (2, 4, 6, 8, 10):
        assert ledger.is_done("w", "i", seq)
    assert not ledger.is_done("w", "i", 9)
    assert not ledger.is_done("w", "i", 11)


def test_window_jump_never_forgets_completed_pushes():
    """BUG (ps_server/core/ledger.py, PushLedger.finish): a push that completes
    after the window jumped past it is added to ``done_above`` below
    ``done_below``; the next jump sets ``done_below = min(done_above)``, moving
    the mark *backwards*, so pushes that were done become "not done" and a
    retry of one of them is applied a second time (exactly-once violated).
    """
    ledger = PushLedger(max_done_window=2)
    slow = ledger.begin("w", "i", 1, 4)  # still streaming
    for seq in (2, 3, 4):
        _complete(ledger, "w", "i", seq)
    # The window overflowed: push 1 is written off, 2 to 4 are done.
    _assert_written_off(ledger, 1)
    assert all(ledger.is_done("w", "i", s) for s in (2, 3, 4))
    # The slow push finishes after all: the ledger now knows it is complete.
    assert slow.claim("v", 0, 4) == ClaimResult.APPLY
    assert slow.done("v", 0)
    ledger.finish(slow)
    assert ledger.is_done("w", "i", 1) and ledger.begin("w", "i", 1, 4) is None
    _complete(ledger, "w", "i", 6)
    _complete(ledger, "w", "i", 7)  # overflows the window again
    for seq in (1, 2, 3, 4, 6, 7):
        assert ledger.is_done("w", "i", seq), f"push {seq} was completed but is forgotten"
    assert ledger.begin("w", "i", 3, 4) is None, "push 3 would be applied twice"


def test_written_off_pushes_do_not_count_as_unfinished():
    """BUG (ps_server/core/ledger.py, PushLedger.finish/begin): a push the
    window wrote off as abandoned (``is_done`` now says True) stays in
    ``state.open`` forever and keeps counting against ``max_open_pushes``.
    The worker client never retries a failed push's sequence, so every push
    that fails midway leaves such an entry; after ``max_open_pushes`` (64)
    failures the worker gets MEMORY_LIMIT on every push to that shard until
    it restarts.
    """
    ledger = PushLedger(max_open_pushes=2, max_done_window=2)
    ledger.begin("w", "i", 1, 4)  # cut off, never retried
    for seq in (2, 3, 4):
        _complete(ledger, "w", "i", seq)
    _assert_written_off(ledger, 1)  # the window wrote push 1 off
    ledger.begin("w", "i", 5, 4)  # really unfinished: one open push
    assert ledger.begin("w", "i", 6, 4) is not None


def test_open_pushes_are_bounded_by_writing_off_the_oldest():
    ledger = PushLedger(max_open_pushes=2)
    first = ledger.begin("w", "i", 1, 4)
    second = ledger.begin("w", "i", 2, 4)
    third = ledger.begin("w", "i", 3, 4)
    assert third is not None
    state = ledger._states[("w", "i")]
    assert sorted(state.open) == [2, 3]
    # The oldest was written off as abandoned: a retry of it is refused with
    # a reason of its own (it may be partly applied), neither applied a second
    # time nor answered as a duplicate.
    _assert_written_off(ledger, 1)
    # Rejoining a push that is still open returns the same session.
    assert ledger.begin("w", "i", 2, 4) is second
    assert ledger.begin("w", "j", 1, 4) is not None  # other incarnations are independent
    # The written-off session may still finish on its own stream: then it is known complete.
    first.claim("v", 0, 4)
    first.done("v", 0)
    ledger.finish(first)
    assert sorted(state.open) == [2, 3] and ledger.is_done("w", "i", 1)
    assert ledger.begin("w", "i", 1, 4) is None


def _assert_written_off(ledger: PushLedger, sequence: int, worker: str = "w", incarnation: str = "i") -> None:
    assert not ledger.is_done(worker, incarnation, sequence)
    for call in (lambda: ledger.check(worker, incarnation, sequence),
                 lambda: ledger.begin(worker, incarnation, sequence, 4)):
        with pytest.raises(RequestError) as info:
            call()
        assert info.value.reason == Reason.PUSH_WRITTEN_OFF
        assert f"push {sequence} of worker {worker!r}" in info.value.message
        assert "partly applied" in info.value.message


def test_written_off_pushes_stay_written_off_past_the_mark_and_through_a_snapshot():
    ledger = PushLedger(max_open_pushes=2)
    for seq in (1, 2, 3, 4):
        ledger.begin("w", "i", seq, 4)  # 1 and 2 are written off by 3 and 4
    for seq in (3, 4, 5):
        _complete(ledger, "w", "i", seq)
    state = ledger._states[("w", "i")]
    assert state.done_below == 6 and state.written_off == [[1, 3]]
    _assert_written_off(ledger, 1)
    _assert_written_off(ledger, 2)
    assert ledger.check("w", "i", 3) is True and ledger.begin("w", "i", 5, 4) is None
    restored = PushLedger(max_open_pushes=2)
    restored.restore(json.loads(json.dumps(ledger.snapshot())))
    _assert_written_off(restored, 1)
    _assert_written_off(restored, 2)
    assert restored.is_done("w", "i", 4) and not restored.is_done("w", "i", 6)


def test_written_off_ranges_are_bounded_and_what_is_forgotten_counts_as_written_off():
    ledger = PushLedger(max_open_pushes=1, max_written_off_ranges=2)
    _complete(ledger, "w", "i", 1)
    # Pushes 2, 4, 6 are cut and written off by 3, 5, 7, which complete.
    for seq in range(2, 8):
        session = ledger.begin("w", "i", seq, 4)
        if seq % 2:
            session.claim("v", 0, 4)
            session.done("v", 0)
            ledger.finish(session)
    state = ledger._states[("w", "i")]
    assert state.written_off == [[4, 5], [6, 7]] and state.forgotten_below == 3
    # Forgotten: push 1 completed, but the ledger no longer knows it, so it never says duplicate.
    _assert_written_off(ledger, 1)
    _assert_written_off(ledger, 2)
    _assert_written_off(ledger, 4)
    assert all(ledger.is_done("w", "i", s) for s in (3, 5, 7))


# ---- memory bounds -----------------------------------------------------------------------------


class _Budget:
    """A store's booking, reduced to a counter with a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def book(self, nbytes: int) -> None:
        if self.held + nbytes > self.limit:
            raise RequestError(Reason.MEMORY_LIMIT, f"{nbytes} bytes do not fit")
        self.held += nbytes

    def give_back(self, cell: list[int]) -> None:
        self.held -= cell[0]


def test_a_push_records_at_most_its_bound_of_chunks():
    budget = _Budget(1 << 30)
    session = PushLedger().begin("w", "i", 1, 10_000)
    session.bound(5, budget.book, budget.give_back)
    for offset in range(5):
        assert session.claim("v", offset, 1) == ClaimResult.APPLY
        session.done("v", offset)
    with pytest.raises(RequestError) as info:
        session.claim("v", 5, 1)
    assert info.value.reason == Reason.MEMORY_LIMIT and "send larger chunks" in info.value.message
    assert session.to_json()["chunks"] == {"v": [[i, 1] for i in range(5)]}  # nothing recorded
    assert session.claim("v", 0, 1) == ClaimResult.ALREADY_APPLIED  # a retry still works
    with pytest.raises(RequestError):
        session.make_room(1)


def test_a_message_of_too_many_chunks_is_refused_before_any_is_recorded():
    budget = _Budget(1 << 30)
    session = PushLedger().begin("w", "i", 1, 10_000)
    session.bound(100, budget.book, budget.give_back)
    session.make_room(100)
    with pytest.raises(RequestError) as info:
        session.make_room(101)
    assert info.value.reason == Reason.MEMORY_LIMIT and "101 more would pass the 100" in info.value.message
    assert session.to_json()["chunks"] == {}


def test_records_are_booked_before_they_are_made_and_given_back_when_the_push_is_gone():
    budget = _Budget(SESSION_BYTES + 100 * RECORD_BYTES)
    ledger = PushLedger(max_open_pushes=1)
    session = ledger.begin("w", "i", 1, 10_000)
    session.bound(10_000, budget.book, budget.give_back)
    assert budget.held == SESSION_BYTES
    for offset in range(64):
        session.claim("v", offset, 1)
        session.done("v", offset)
    assert budget.held == SESSION_BYTES + 64 * RECORD_BYTES  # one block
    with pytest.raises(RequestError) as info:  # the next block does not fit
        session.claim("v", 64, 1)
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert len(session.to_json()["chunks"]["v"]) == 64
    del session, info  # (the traceback holds the session too)
    ledger.begin("w", "i", 2, 4)  # writes push 1 off: the ledger drops it
    assert budget.held == 0


def test_staged_bytes_are_booked_and_given_back_with_the_push():
    budget = _Budget(SESSION_BYTES + 1000)
    ledger = PushLedger(max_open_pushes=1)
    session = ledger.begin("w", "i", 1, 10)
    session.bound(100, budget.book, budget.give_back)
    session.book_bytes(600)
    with pytest.raises(RequestError) as info:
        session.book_bytes(401)
    assert info.value.reason == Reason.MEMORY_LIMIT and budget.held == SESSION_BYTES + 600
    del session, info
    ledger.begin("w", "i", 2, 4)  # writes push 1 off
    assert budget.held == 0


def test_incarnations_are_forgotten_least_recently_used_first():
    ledger = PushLedger(max_incarnations=2)
    _complete(ledger, "w", "a", 1)
    _complete(ledger, "w", "b", 1)
    _complete(ledger, "w", "a", 2)  # touches a: b is now the oldest
    _complete(ledger, "w", "c", 1)
    assert ledger.is_done("w", "a", 1) and ledger.is_done("w", "c", 1)
    assert not ledger.is_done("w", "b", 1)
    assert len(ledger._states) == 2


# ---- sessions: chunk claims ---------------------------------------------------------------------


def _session(total=100):
    return PushSession(("w", "i", 1), total)


def test_claim_and_done():
    s = _session(30)
    assert s.claim("v", 0, 10) == ClaimResult.APPLY
    assert not s.complete
    assert s.done("v", 0) is False
    assert s.claim("v", 0, 10) == ClaimResult.ALREADY_APPLIED
    assert s.claim("v", 20, 10) == ClaimResult.APPLY
    assert s.claim("v", 10, 10) == ClaimResult.APPLY  # fills the gap exactly
    assert s.done("v", 20) is False
    assert s.done("v", 10) is True, "the last chunk completes the push"
    assert s.complete and s.finalized
    assert s.applied_elements == 30
    assert s.claim("v", 10, 10) == ClaimResult.ALREADY_APPLIED


def test_done_reports_completion_once():
    s = _session(5)
    s.claim("v", 0, 5)
    assert s.done("v", 0) is True
    assert s.finalized


def test_chunks_of_different_variables_do_not_overlap():
    s = _session(20)
    assert s.claim("v", 0, 10) == ClaimResult.APPLY
    assert s.claim("u", 0, 10) == ClaimResult.APPLY
    s.done("v", 0)
    assert s.done("u", 0) is True


@pytest.mark.parametrize("offset, count", [
    (10, 5),  # same start, shorter
    (10, 20),  # same start, longer
    (5, 10),  # starts inside, ends after
    (15, 10),  # starts inside, ends inside
    (12, 3),  # strictly inside
    (5, 30),  # covers it
    (19, 1),  # last element
    (5, 6),  # ends on the first element
])
def test_overlapping_chunk_with_different_bounds_is_refused(offset, count):
    s = _session()
    assert s.claim("v", 10, 10) == ClaimResult.APPLY
    s.done("v", 10)
    with pytest.raises(RequestError) as info:
        s.claim("v", offset, count)
    assert info.value.reason == Reason.INVALID_CHUNK
    assert "'v'" in info.value.message
    # The refused chunk left no trace: adjacent chunks are still accepted.
    assert s.claim("v", 0, 10) == ClaimResult.APPLY
    assert s.claim("v", 20, 10) == ClaimResult.APPLY


def test_overlap_with_a_chunk_being_applied_is_refused_too():
    s = _session()
    assert s.claim("v", 10, 10) == ClaimResult.APPLY  # not done yet
    with pytest.raises(RequestError) as info:
        s.claim("v", 15, 10)
    assert info.value.reason == Reason.INVALID_CHUNK


def test_second_stream_waits_for_the_first_and_gets_already_applied():
    s = _session(10)
    assert s.claim("v", 0, 10) == ClaimResult.APPLY
    results = []
    started = threading.Event()

    def retry():
        started.set()
        results.append(s.claim("v", 0, 10))

    thread = threading.Thread(target=retry, daemon=True)
    thread.start()
    assert started.wait(5)
    thread.join(0.2)
    assert thread.is_alive(), "the retry must wait while the chunk is being applied"
    assert results == []
    assert s.done("v", 0) is True
    thread.join(5)
    assert not thread.is_alive()
    assert results == [ClaimResult.ALREADY_APPLIED]
    assert s.applied_elements == 10, "the chunk was counted once"


def test_racing_streams_apply_each_chunk_exactly_once():
    total, chunk = 400, 10
    s = PushSession(("w", "i", 1), total)
    applied = [0] * (total // chunk)
    completions = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def stream():
        barrier.wait()
        for offset in range(0, total, chunk):
            if s.claim("v", offset, chunk) == ClaimResult.APPLY:
                with lock:
                    applied[offset // chunk] += 1
                if s.done("v", offset):
                    completions.append(offset)

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert applied == [1] * (total // chunk)
    assert len(completions) == 1
    assert s.complete and s.applied_elements == total


def test_claim_with_step_reserves_once_and_nothing_for_an_applied_chunk():
    s = _session(20)
    calls = []

    def reserve():
        calls.append(1)
        return 70 + len(calls)

    assert s.claim_with_step("v", 0, 10, reserve) == 71
    assert s.done("v", 0) is False
    assert s.claim_with_step("v", 0, 10, reserve) is None, "applied before: nothing to do"
    assert s.claim_with_step("v", 10, 10, reserve) == 71, "the variable's next chunk reuses its step"
    assert s.done("v", 10) is True
    assert len(calls) == 1 and s.steps == {"v": 71}
    with pytest.raises(RequestError) as err:
        s.claim_with_step("v", 5, 10, reserve)
    assert err.value.reason == Reason.INVALID_CHUNK
    assert len(calls) == 1, "a refused chunk reserves no step"


def test_a_released_chunk_wakes_the_waiting_retry_which_applies_it():
    s = _session(10)
    assert s.claim_with_step("v", 0, 10, lambda: 1) == 1
    results = []
    started = threading.Event()

    def retry():
        started.set()
        results.append(s.claim_with_step("v", 0, 10, lambda: 2))

    thread = threading.Thread(target=retry, daemon=True)
    thread.start()
    assert started.wait(5)
    thread.join(0.2)
    assert thread.is_alive(), "the retry waits while the first stream applies the chunk"
    s.release("v", 0)  # the first stream failed to apply it
    thread.join(5)
    assert not thread.is_alive()
    assert results == [1], "the retry claims the chunk, with the step reserved before"
    assert s.done("v", 0) is True


def test_an_empty_push_is_finalized_by_exactly_one_of_its_racing_streams():
    session = PushSession(("w", "i", 1), 0)
    winners = []
    barrier = threading.Barrier(8)

    def race():
        barrier.wait()
        winners.append(session.finalize_empty())

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert winners.count(True) == 1
    assert not PushSession(("w", "i", 2), 4).finalize_empty()  # a push with elements completes by its chunks
