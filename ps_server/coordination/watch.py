"""One etcd watch on its own thread, resumed from the last revision seen after a lost connection.

etcd keeps the history of every key (until compaction), so a watch reopened
at "last delivered revision + 1" sees exactly the changes made while it was
disconnected: none missed, none twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.etcd_ops import KeyValue, WatchEvent
from ps_server.coordination.etcdpb import etcd_pb2
from wehub_ps.process.logs import event

__all__ = ["Watcher"]

_log = logging.getLogger(__name__)

#: Waits between reopening attempts while etcd is away: short first, then capped (no busy loop).
_RETRY_FIRST, _RETRY_MAX = 0.1, 1.0
#: While etcd stays away, one warning per this many seconds.
_WARN_EVERY = 5.0


class Watcher:
    """A running watch; built by ``EtcdClient.watch``.

    The callback runs on the watcher's thread, one event at a time, in
    revision order; an exception in it is logged and the watch goes on.
    ``stop()`` may be called from any thread, the callback's included.
    """

    def __init__(self, create: etcd_pb2.WatchCreateRequest, start_revision: int,
                 open_stream: Callable[[Iterator[etcd_pb2.WatchRequest]], Any],
                 note_failure: Callable[[grpc.RpcError], None], callback: Callable[[WatchEvent], None],
                 *, name: str) -> None:
        self._create = create
        self._next_revision = start_revision
        self._open_stream = open_stream
        self._note_failure = note_failure
        self._callback = callback
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._created = threading.Event()

    @property
    def name(self) -> str:
        return self._thread.name

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def wait_created(self, timeout: float) -> bool:
        """Whether etcd confirmed the watch within ``timeout`` seconds (changes after that are seen)."""
        return self._created.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """End the watch: no callback starts after this returns (unless called from the callback)."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)

    def _requests(self, done: threading.Event) -> Iterator[etcd_pb2.WatchRequest]:
        create = etcd_pb2.WatchCreateRequest()
        create.CopyFrom(self._create)
        create.start_revision = self._next_revision
        yield etcd_pb2.WatchRequest(create_request=create)
        done.wait()  # keep the stream open until it ends; gRPC's sender thread waits here

    def _run(self) -> None:
        retry = _RETRY_FIRST
        down_since: float | None = None
        last_warning = 0.0
        while not self._stopped.is_set():
            done = threading.Event()
            call = None
            try:
                call = self._open_stream(self._requests(done))
                with self._lock:
                    self._call = call
                if self._stopped.is_set():
                    call.cancel()
                    break
                for response in call:
                    if response.created:
                        self._created.set()
                        if self._next_revision == 0:
                            self._next_revision = response.header.revision + 1
                        if down_since is not None:
                            event(_log, logging.WARNING, "etcd watch resumed", watch=self.name,
                                  down_seconds=round(time.monotonic() - down_since, 3),
                                  from_revision=self._next_revision)
                        down_since, retry = None, _RETRY_FIRST
                    if response.canceled:
                        self._restart_after_cancel(response)
                        break
                    for item in response.events:
                        self._deliver(item)
            except grpc.RpcError as error:
                if self._stopped.is_set():
                    break
                self._note_failure(error)
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                if now - last_warning >= _WARN_EVERY:
                    last_warning = now
                    event(_log, logging.WARNING, "etcd watch lost its connection; reopening", watch=self.name,
                          code=error.code().name, details=error.details(), from_revision=self._next_revision)
            except CoordinationError:  # the client was closed
                break
            finally:
                done.set()
                with self._lock:
                    self._call = None
                if call is not None:
                    call.cancel()
            if self._stopped.wait(retry):
                break
            retry = min(retry * 2, _RETRY_MAX)

    def _restart_after_cancel(self, response: etcd_pb2.WatchResponse) -> None:
        if response.compact_revision:
            # The history before compact_revision is gone: changes in between cannot be replayed.
            event(_log, logging.WARNING, "etcd compacted the history this watch needed; resuming at the "
                  "oldest revision kept", watch=self.name, wanted=self._next_revision,
                  resumed_at=response.compact_revision)
            self._next_revision = response.compact_revision
        else:
            event(_log, logging.WARNING, "etcd canceled the watch; reopening", watch=self.name,
                  reason=response.cancel_reason)

    def _deliver(self, item: etcd_pb2.Event) -> None:
        kind = "delete" if item.type == etcd_pb2.Event.DELETE else "put"
        self._next_revision = item.kv.mod_revision + 1
        if self._stopped.is_set():
            return
        try:
            self._callback(WatchEvent(kind, KeyValue.from_proto(item.kv)))
        except Exception:  # noqa: BLE001 - a faulty callback must not end the watch
            _log.exception("etcd watch callback failed", extra={"fields": {"watch": self.name}})
