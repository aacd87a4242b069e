"""Where a server keeps its tables' disk tiers (``--disk-tier-dir``), and cleaning up after crashed ones.

Each server process writes under ``<dir>/<server id>/``, which it holds
with an exclusive ``flock`` on a lock file while it runs, and removes when it
stops. The files are a cache of state that checkpoints make durable (a
restart restores the rows from its checkpoint), so the directory of a
process that died is garbage: every server removes the directories under
``<dir>`` whose lock nobody holds when it starts. Replicas on one machine
may share ``<dir>``.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import re
import shutil
from pathlib import Path

__all__ = ["DiskTierDirectory"]

_LOCK = "owner.lock"


class DiskTierDirectory:
    """One server process's directory of row files under ``root``."""

    def __init__(self, root: str | os.PathLike, server_id: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / server_id
        self.path.mkdir(exist_ok=True)
        self._lock_fd = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.removed_stale = self._remove_stale()
        self._files = itertools.count(1)

    def file_for(self, table: str) -> Path:
        """A new row file for ``table`` (names may hold ``/`` and ``:``: made safe, kept apart by a hash;
        numbered, so a table restored over an old one never shares its file)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", table)[:80]
        digest = hashlib.sha256(table.encode()).hexdigest()[:12]
        return self.path / f"{safe}-{digest}-{next(self._files)}.rows"

    def close(self) -> None:
        """Remove this process's files (the server stops)."""
        if self._lock_fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _remove_stale(self) -> int:
        removed = 0
        for entry in self.root.iterdir():
            if entry == self.path or not entry.is_dir() or not (entry / _LOCK).exists():
                continue
            try:
                fd = os.open(entry / _LOCK, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue  # a running server's
            shutil.rmtree(entry, ignore_errors=True)
            os.close(fd)
            removed += 1
        return removed
