"""When checkpoints are taken: periodically, on request, and at shutdown.

A checkpoint first takes a snapshot — with the apply gate held exclusive,
every part is copied in memory (the only pause pushes ever see) — then
writes it to disk with the gate released. One checkpoint at a time; the
periodic one is skipped when nothing changed since the last.

Checkpoints by change (``full_every`` > 1): of every ``full_every``
checkpoints one is full and the others deltas of the one before
(ps_server.durability.chains), whose snapshot copies only the table rows
changed since. The chain starts afresh with a full checkpoint after a write
failed (the changes it held were forgotten), after the store's content was
replaced (a replica's snapshot installed), and when a table kept too many
removed ids to list.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore
from ps_server.durability.format import shard_dir
from ps_server.durability.writer import ShardSnapshot, WrittenCheckpoint, clean_temporaries, write_checkpoint
from wehub_ps.process.logs import event

__all__ = ["Checkpointer", "CheckpointRecord"]

log = logging.getLogger("ps_server.durability.checkpointer")


@dataclass(frozen=True)
class CheckpointRecord:
    """A written checkpoint and what it cost."""

    written: WrittenCheckpoint
    pause_seconds: float


class Checkpointer:
    def __init__(self, store: VariableStore, ledger: PushLedger, directory: str, server_id: str,
                 keep: int, interval: float, persist_open_pushes: bool = True,
                 on_written: Callable[[float], None] | None = None,
                 consistency_state: Callable[[], dict[str, Any]] | None = None, full_every: int = 1) -> None:
        """``persist_open_pushes=False`` (sync mode): an unfinished push's chunks live in its
        private staging, never checkpointed, so the ledger leaves them out and a retry after
        a restart sends them again. ``consistency_state()``: the consistency controller's
        snapshot (step, clocks, workers), taken in the same instant as values and ledger."""
        self._store = store
        self._ledger = ledger
        self._directory = directory
        self._server_id = server_id
        self._keep = keep
        self._interval = interval
        self._persist_open_pushes = persist_open_pushes
        self._on_written = on_written
        self._consistency_state = consistency_state
        self._full_every = full_every
        #: The ids of the last checkpoint's chain (its full one first, itself last); None: the next is full.
        self._chain: list[int] | None = None
        self._chain_restores = store.restores
        #: Whether the store holds state worth a checkpoint: a replica that has not yet installed or
        #: led any (ps_server.replication) holds an empty store that must never shadow a real checkpoint.
        self.holds_state: Callable[[], bool] = lambda: True
        # Serialises checkpoints (held during the write) and guards _last_generation.
        self._lock = threading.Lock()
        # Guards _last only, so Describe never waits for a write in progress.
        self._last_lock = threading.Lock()
        self._last: CheckpointRecord | None = None
        self._last_generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        clean_temporaries(shard_dir(directory, store.shard_index, store.num_shards))

    @property
    def last(self) -> CheckpointRecord | None:
        with self._last_lock:
            return self._last

    def mark_restored(self, chain: list[int] | None = None) -> None:
        """The store now equals a checkpoint (whose ``chain``, with itself last, is given when it is
        this shard's own): no need to write it again until it changes; deltas may build on it."""
        with self._lock:
            self._last_generation = self._store.generation
            self._chain = list(chain) if chain else None
            self._chain_restores = self._store.restores

    def checkpoint(self, reason: str, only_if_changed: bool = False,
                   final: bool = False) -> CheckpointRecord | None:
        """Snapshot and write; blocks until the checkpoint is durable. None if skipped.

        ``final`` (shutdown): the snapshot also seals the store's apply gate,
        so nothing is applied after the instant this checkpoint holds.
        RequestError(SHUTTING_DOWN) once the final checkpoint was taken.
        Skipped (None) while the store holds no state (``holds_state``).
        """
        if not self.holds_state():
            event(log, logging.INFO, "checkpoint skipped: this replica holds no state yet", reason=reason)
            return None
        with self._lock:
            paused = time.perf_counter()
            with self._store.gate.exclusive(seal=final):
                generation = self._store.generation
                if only_if_changed and generation == self._last_generation:
                    return None
                chain = self._chain if self._chain_restores == self._store.restores else None
                parts, is_delta = self._store.checkpoint_snapshot(
                    delta=chain is not None and len(chain) < self._full_every)
                snapshot = ShardSnapshot(
                    self._store.shard_index, self._store.num_shards, self._server_id, parts,
                    {"entries": self._ledger.snapshot(self._persist_open_pushes)},
                    consistency=self._consistency_state() if self._consistency_state is not None else None,
                    chain=list(chain) if is_delta and chain is not None else None)
                self._chain, self._chain_restores = None, self._store.restores  # until this one is written
            pause = time.perf_counter() - paused
            written = write_checkpoint(self._directory, snapshot, self._keep)
            self._chain = [*(snapshot.chain or []), int(written.checkpoint_id)]
            if self._store.spec_log is not None:
                try:  # what every kept checkpoint holds needs no record
                    self._store.spec_log.prune()
                except OSError:  # the checkpoint is written; a log kept longer harms nothing
                    log.exception("pruning the spec log failed",
                                  extra={"fields": {"directory": self._directory}})
            record = CheckpointRecord(written, pause)
            with self._last_lock:
                self._last = record
            self._last_generation = generation
        if self._on_written is not None:
            self._on_written(written.write_seconds)
        event(log, logging.INFO, "checkpoint written", reason=reason, checkpoint_id=written.checkpoint_id,
              kind="delta" if snapshot.chain is not None else "full",
              path=str(written.path), bytes=written.bytes, write_seconds=round(written.write_seconds, 3),
              pause_seconds=round(pause, 3))
        return record

    def start_periodic(self) -> None:
        if self._interval <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ps-checkpointer", daemon=True)
        self._thread.start()

    def stop_periodic(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.checkpoint("periodic", only_if_changed=True)
            except Exception:  # a full disk must not kill the server; keep trying
                log.exception("periodic checkpoint failed", extra={"fields": {"directory": self._directory}})
