"""``ps-local --script train.py``: a user's own training script on a local cluster, one copy per worker.

Like ``torchrun`` for a parameter server: ps-local starts the servers (and
etcd when shards are replicated), then runs N copies of the script with
the environment ``PSClient.from_env`` reads (``PS_ADDRESSES``,
``PS_WORKER_ID``) plus ``PS_WORKER_INDEX`` and ``PS_NUM_WORKERS`` for the
script's own data sharding. Their output (stdout and stderr) is streamed
with a ``[worker-i]`` prefix. When every copy has exited 0, or one fails,
everything ps-local started is stopped by PID; ps-local exits with the
first failing copy's status (0 when all succeeded).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from typing import TextIO

from ps_local.processes import ManagedProcess, ProcessGroup
from wehub_ps.cluster import ADDRESSES_ENV, NUM_WORKERS_ENV, WORKER_ID_ENV, WORKER_INDEX_ENV

__all__ = ["ScriptFailed", "run_script", "worker_environment"]


class ScriptFailed(RuntimeError):
    """A copy of the script exited non-zero (or ran past --timeout); ``status`` is ps-local's exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def worker_environment(addresses: list[str], index: int, count: int) -> dict[str, str]:
    """What copy ``index`` of ``count`` finds in its environment."""
    return {ADDRESSES_ENV: ",".join(addresses), WORKER_ID_ENV: f"worker-{index}",
            WORKER_INDEX_ENV: str(index), NUM_WORKERS_ENV: str(count)}


def _stream(proc: ManagedProcess, lines: queue.Queue[tuple[str, str | None]]) -> None:
    """Each line the copy writes, then None when its output closes."""
    assert proc.popen.stdout is not None
    for line in proc.popen.stdout:
        lines.put((proc.name, line))
    lines.put((proc.name, None))


def run_script(group: ProcessGroup, args: argparse.Namespace, addresses: list[str], out: TextIO) -> None:
    """Run ``args.num_workers`` copies of ``args.script`` to the end; ScriptFailed when one fails."""
    script = os.path.abspath(args.script)
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    workers = []
    for i in range(args.num_workers):
        proc = group.start(f"worker-{i}", [sys.executable, script, *args.script_args], capture_stdout=True,
                           merge_stderr=True, env=worker_environment(addresses, i, args.num_workers))
        threading.Thread(target=_stream, args=(proc, lines), name=f"read-{proc.name}", daemon=True).start()
        workers.append(proc)
    open_outputs = len(workers)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        try:
            name, line = lines.get(timeout=0.2)
            if line is None:
                open_outputs -= 1
            else:
                out.write(f"[{name}] {line}" if line.endswith("\n") else f"[{name}] {line}\n")
                out.flush()
        except queue.Empty:
            pass
        failed = [w for w in workers if w.popen.poll() not in (None, 0)]
        if failed:
            w = failed[0]
            _drain(lines, out)
            status = w.popen.returncode if w.popen.returncode > 0 else 128 - w.popen.returncode
            raise ScriptFailed(f"{w.name} ({args.script}) exited with code {w.popen.returncode}", status)
        if open_outputs == 0 and all(w.popen.poll() == 0 for w in workers):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise ScriptFailed(f"{args.script} did not finish within --timeout {args.timeout:g}s", 124)


def _drain(lines: queue.Queue[tuple[str, str | None]], out: TextIO, grace: float = 0.5) -> None:
    """Print what the copies wrote before a failure (its traceback first of all)."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            name, line = lines.get(timeout=0.05)
        except queue.Empty:
            continue
        if line is not None:
            out.write(f"[{name}] {line}" if line.endswith("\n") else f"[{name}] {line}\n")
    out.flush()
