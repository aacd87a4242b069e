"""``ps-server``: run one shard until SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from ps_server.coordination import CoordinationError
from ps_server.durability.format import CheckpointError
from ps_server.ops.config import ConfigError, parse_config
from ps_server.server import create_server
from wehub_ps.kernels.compiled import cache_in
from wehub_ps.process.allocator import keep_freed_buffers
from wehub_ps.process.logs import configure, event

log = logging.getLogger("ps_server")

#: numba's cache of compiled loops, inside the checkpoint directory (no shard's layout matches the name).
COMPILED_LOOPS_DIR = ".compiled-loops"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level)
    if config.checkpoint_dir:
        # On the volume that outlives a restarted container: its compiled loops load instead of compiling.
        cache_in(os.path.join(config.checkpoint_dir, COMPILED_LOOPS_DIR))
    if config.keep_freed_bytes:
        keep_freed_buffers(trim_threshold=config.keep_freed_bytes, arena_max=config.malloc_arenas or None)
    if config.unknown_environment:
        event(log, logging.WARNING, "unknown PS_ environment variables ignored (misspelled settings?)",
              variables=list(config.unknown_environment))
    try:
        server = create_server(config)
    except (OSError, RuntimeError) as exc:
        event(log, logging.ERROR, "cannot start", error=str(exc), host=config.host, port=config.port)
        return 1
    stop = threading.Event()

    def request_stop(signum: int, _frame) -> None:
        event(log, logging.INFO, "signal received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        server.start()
    except CheckpointError as exc:
        event(log, logging.ERROR, "cannot restore", error=str(exc))
        server.grpc_server.stop(0)
        return 1
    except CoordinationError as exc:
        event(log, logging.ERROR, f"cannot start: this replica could not join its replica set through etcd "
              f"at {config.etcd_endpoints} (--etcd-endpoints) within --etcd-start-timeout "
              f"{config.etcd_start_timeout:g} s", error=str(exc), etcd_endpoints=config.etcd_endpoints)
        server.grpc_server.stop(0)
        return 1
    while not stop.wait(0.2):
        if server.finish_requested.is_set():
            event(log, logging.INFO, "finishing: the job is done")
            break
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
