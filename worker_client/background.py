"""Pushes that go out in the background: ``push(..., wait=False)`` and the overlapped step.

One job at a time per client, on a thread of its own: a push (the same
:meth:`Pushes.push` a blocking push runs, so sequences, retries and the
servers' ledger work exactly as for it) and, for a step that pulls ahead,
the values of a later step read right after it. Starting a job first waits
for the one in flight, so at most one step is in flight and the gradient
copies (:class:`GradientCopies`) are reused push after push.

A failed push is never lost from sight: its handle's ``wait()`` raises the
error, and if nobody waited for it, the next call of the client raises it
(once) before doing anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wehub_ps.process.logs import event
from worker_client.arrays import check_array, check_ids, is_gpu_array, to_host
from worker_client.errors import InvalidArgumentError, OverlapRefusedError, PSError
from worker_client.gpu import LazyGpuTransfers
from worker_client.prefetch import NextPull, Prefetches
from worker_client.pulls import Puller
from worker_client.pushes import Pushes
from worker_client.registry import Registry
from worker_client.session import Session

__all__ = ["BackgroundPushes", "GradientCopies", "Job", "PushHandle"]

log = logging.getLogger("worker_client")

#: Pinned buffers (GPU gradients) of background pushes are named under this tag.
_GPU_TAG = "background-push"


@dataclass
class Job:
    """One background push (and the values read after it); ``observed`` once its error was raised."""

    future: futures.Future
    #: The thread that handed it off, the pull it reads after the push, and the pushes
    #: this client had started when the values were read (set by the job).
    thread: int
    then_pull: NextPull | None
    values: dict[str, np.ndarray] | None = None
    read_at_generation: int = 0
    observed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_error(self) -> BaseException | None:
        """The push's error if nobody has seen it yet (it is then seen)."""
        if not self.future.done() or self.future.cancelled():
            return None
        error = self.future.exception()
        with self.lock:
            if error is None or self.observed:
                return None
            self.observed = True
        return error


class PushHandle:
    """What ``push(..., wait=False)`` returns: the push in the background.

    ``wait()`` returns the shards pushed to, or raises the push's error (a
    :class:`PSError`, as a blocking ``push`` would). ``done()`` tells
    whether it finished, either way.
    """

    def __init__(self, job: Job) -> None:
        self._job = job

    def done(self) -> bool:
        return self._job.future.done()

    def wait(self, timeout: float | None = None) -> set[int]:
        """Block until the push finished (TimeoutError past ``timeout``); its shards, or its error."""
        try:
            return self._job.future.result(timeout)
        except futures.TimeoutError:
            raise TimeoutError(f"the background push did not finish within {timeout} s") from None
        except BaseException:
            with self._job.lock:
                self._job.observed = True
            raise


class GradientCopies:
    """Copies of the gradients handed to a background push, in buffers reused push after push.

    The caller may change or reuse its arrays as soon as the push is handed
    off. One set of buffers suffices: the next push is copied in only after
    the previous one finished. GPU gradients land in pinned host buffers.
    """

    def __init__(self, gpu: LazyGpuTransfers) -> None:
        self._gpu = gpu
        self._dense: dict[str, np.ndarray] = {}
        # Row pushes vary in length: buffers keep their largest size, a view is used.
        self._rows: dict[tuple[str, str], np.ndarray] = {}

    def copy(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]]
             ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
        on_gpu = {name: g for name, g in gradients.items() if type(g) is not np.ndarray and is_gpu_array(g)}
        dense = self._gpu.get().download_all(on_gpu, _GPU_TAG) if on_gpu else {}
        for name, grad in gradients.items():
            if name not in dense:
                dense[name] = self._copy_into(self._dense, name, to_host(grad, f"gradients[{name!r}]"))
        copied_rows = {}
        for name, pair in rows.items():
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"rows[{name!r}] must be a tuple (ids, gradients), got {type(pair).__name__}")
            ids = check_ids(pair[0], "ids")
            grads = pair[1]
            host = (self._gpu.get().download_all({name: grads}, f"{_GPU_TAG}-rows")[name]
                    if is_gpu_array(grads) else to_host(grads, f"rows[{name!r}] gradients"))
            copied_rows[name] = (self._grow((name, "ids"), ids), self._grow((name, "grads"), host))
        return dense, copied_rows

    @staticmethod
    def _copy_into(buffers: dict[str, np.ndarray], name: str, host: np.ndarray) -> np.ndarray:
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != host.shape or buffer.dtype != host.dtype:
            buffers[name] = buffer = np.empty(host.shape, dtype=host.dtype)
        np.copyto(buffer, host)
        return buffer

    def _grow(self, key: tuple[str, str], host: np.ndarray) -> np.ndarray:
        buffer = self._rows.get(key)
        if (buffer is None or buffer.dtype != host.dtype or buffer.shape[1:] != host.shape[1:]
                or len(buffer) < len(host)):
            self._rows[key] = buffer = np.empty(host.shape, dtype=host.dtype)
        view = buffer[:len(host)]
        np.copyto(view, host)
        return view


class BackgroundPushes:
    """The client's background jobs: one in flight at most, on the thread ``ps-push-{worker_id}``.

    ``prefetch``: a push that reads values after it may bring them back in
    its answer (``PushBegin.pull_after``, as a step's push does), else they
    are pulled once the push is confirmed.
    """

    def __init__(self, session: Session, registry: Registry, pushes: Pushes, puller: Puller,
                 prefetches: Prefetches, gpu: LazyGpuTransfers, prefetch: bool) -> None:
        self._session = session
        self._registry = registry
        self._pushes = pushes
        self._puller = puller
        self._prefetches = prefetches
        self._prefetch = prefetch
        self._copies = GradientCopies(gpu)
        # Guards _in_flight and _executor; one hand-off at a time (it waits for the job in flight).
        self._lock = threading.RLock()
        self._in_flight: Job | None = None
        self._executor: futures.ThreadPoolExecutor | None = None

    def refuse_unless_async(self, what: str) -> None:
        """OverlapRefusedError unless the servers run asynchronous mode."""
        mode = self._session.consistency
        if mode != "async":
            raise OverlapRefusedError(
                f"{what} needs --consistency async; the servers run {mode!r}, where a step's pull must see "
                "this worker's previous push (its staleness bound or step barrier counts on it). "
                "Use a blocking push() / step() here")

    def raise_failure(self) -> None:
        """Raise the error of a finished background push nobody has seen yet (without waiting)."""
        job = self._in_flight
        if job is not None:
            error = job.take_error()
            if error is not None:
                raise error

    def idle(self) -> bool:
        """Whether no job was handed off since the last one was settled."""
        return self._in_flight is None

    def settle(self) -> Job | None:
        """Wait for the job in flight and return it; raises its push's error if nobody saw it yet."""
        with self._lock:
            job = self._in_flight
            if job is None:
                return None
            futures.wait([job.future])
            self._in_flight = None
        error = job.take_error()
        if error is not None:
            raise error
        return job

    def start(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
              then_pull: NextPull | None = None) -> tuple[PushHandle, Job | None]:
        """Hand off a push (and the values to read after it), once the job in flight is done.

        Returns its handle and the job it waited for. The gradients are
        checked and copied before this returns: the caller may change them.
        Nothing is sent when the job in flight failed unseen: its error is raised.
        """
        self.refuse_unless_async("push(wait=False)")
        if not isinstance(gradients, Mapping):
            raise TypeError(f"gradients must be a mapping name -> array, got {type(gradients).__name__}")
        with self._lock:
            previous = self.settle()
            dense, copied_rows = self._checked_copies(gradients, dict(rows or {}))
            job = Job(futures.Future(), threading.get_ident(), then_pull)
            if self._executor is None:
                self._executor = futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"ps-push-{self._session.worker_id}")
            self._executor.submit(self._run, job, dense, copied_rows)
            self._in_flight = job
        return PushHandle(job), previous

    def _checked_copies(self, gradients: Mapping[str, Any], rows: dict[str, tuple[Any, Any]]
                        ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Copies of the gradients, after the checks that need no server: a wrong shape raises here."""
        names = [*gradients, *rows]
        variables = {v.name: v for v in self._registry.resolve(names)} if names else {}
        dense, copied_rows = self._copies.copy(gradients, rows)
        for name, host in dense.items():
            spec = variables[name].spec
            if spec.hash_table:
                raise InvalidArgumentError(
                    f"{name!r} is a hash table: send its rows with rows={{name: (ids, grads)}}")
            check_array(host, spec.shape, spec.dtype, f"gradient for {name!r}")
        for name, (ids, host) in copied_rows.items():
            spec = variables[name].spec
            row_shape = spec.shape if spec.hash_table else spec.shape[1:]
            check_array(host, (len(ids), *row_shape), spec.dtype, f"gradients for {name!r}")
        return dense, copied_rows

    def _run(self, job: Job, dense: dict[str, np.ndarray],
             rows: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """The job, on the background thread: the push, then the values asked for."""
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            shards: set[int] = set()
            if dense or rows:
                generation = self._prefetches.generation + 1  # the push about to start
                shards = self._pushes.push(dense, rows, job.then_pull if self._prefetch else None)
                self._read_after(job, generation, brought_back=self._prefetch)
            else:
                self._read_after(job, self._prefetches.generation, brought_back=False)
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note("raised by a push sent in the background (push(wait=False) or "
                               "step(overlap=True)); like a push() that raised, it may be partly applied")
            job.future.set_exception(error)
        else:
            job.future.set_result(shards)

    def _read_after(self, job: Job, generation: int, brought_back: bool) -> None:
        """The values ``job.then_pull`` asks for: brought back by the push, or pulled now.

        A pull that fails leaves none (the step that wanted them pulls
        itself, and raises if it cannot); the push's outcome stands.
        """
        wanted = job.then_pull
        if wanted is None:
            return
        prefetch = self._prefetches.take() if brought_back else None  # what the push just brought back
        if prefetch is not None and prefetch.next_pull == wanted:
            job.values, job.read_at_generation = prefetch.out, generation
            return
        try:
            before = self._prefetches.generation
            job.values = self._puller.pull(list(wanted.names) if wanted.names is not None else None)
            job.read_at_generation = before
        except PSError as error:
            log.debug("a pull ahead failed (the next step pulls itself): %s", error)

    def flush(self) -> None:
        """Wait for the background push in flight; raise its error if nobody has seen it yet."""
        self.settle()

    def close(self) -> None:
        """Wait for the job in flight and stop the thread; an error nobody saw is logged as a warning."""
        with self._lock:
            job, self._in_flight = self._in_flight, None
            executor, self._executor = self._executor, None
        if job is not None:
            futures.wait([job.future])
            error = job.take_error()
            if error is not None:
                event(log, logging.WARNING,
                      f"a background push failed and no call raised it before close: {error}",
                      error=str(error), type=type(error).__name__,
                      meaning="that push may be partly applied, like a push() that raised")
        if executor is not None:
            executor.shutdown(wait=True)
