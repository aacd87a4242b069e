"""Explicit initial values: each upload staged in its own buffer, installed whole, exactly once.

A variable created from an array waits for its value: the client uploads
it as an ASSIGN push. Creators racing with equal arrays each upload; the
first complete upload becomes the value (recorded in the spec log first),
the others change nothing. A buffer counts against the memory limit until
it is installed or dropped; the bytes the create booked for the first
upload (the part's upload share) are handed from upload to upload so that
racing creators do not refuse each other.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Callable

import numpy as np

from ps_server.core.errors import RequestError
from ps_server.core.gate import ApplyGate
from ps_server.core.memory import MemoryBook
from ps_server.core.parts import VariablePart
from ps_server.core.persistence import SpecRecorder
from wehub_ps.errors import Reason

__all__ = ["InitialUpload", "InitialValues", "UPLOAD_WAIT_SECONDS"]

#: How long an upload of an initial value waits for a buffer while another upload of the same
#: value holds the part's upload share (see VariableStore.stage_upload).
UPLOAD_WAIT_SECONDS = 60.0


class InitialUpload:
    """One upload of a part's explicit initial value, kept apart until it is complete.

    Chunks land in the upload's own buffer, never in the part, so an upload
    that loses the race (another one completed first) or arrives after
    training started changes nothing. Its bytes count against the memory
    limit until :meth:`drop` (or until nothing refers to it any more).
    """

    def __init__(self, part: VariablePart, nbytes: int, release: Callable[[int], None]) -> None:
        self.part = part
        # Guards buffer: chunk writes against the drop.
        self.lock = threading.Lock()
        self.buffer: np.ndarray | None = np.empty(part.elements, dtype=part.spec.dtype)
        # Gives the reservation back exactly once: at drop, or when the upload is garbage.
        self._release = weakref.finalize(self, release, nbytes)

    def write(self, offset: int, values: np.ndarray) -> None:
        """Stage elements [offset, offset + values.size); nothing once dropped."""
        with self.lock:
            if self.buffer is not None:
                np.copyto(self.buffer[offset : offset + values.size], values, casting="unsafe")

    def drop(self) -> None:
        """Forget the staged bytes (the part has its value) and give back their memory."""
        with self.lock:
            self.buffer = None
        self._release()


class InitialValues:
    """The uploads of a shard's parts; thread-safe (on the memory book's lock)."""

    def __init__(self, memory: MemoryBook, gate: ApplyGate, changed: Callable[[], None]) -> None:
        self._memory = memory
        self._gate = gate
        #: Called (gate held shared) when an upload became a part's value.
        self._changed = changed
        # Uploads waiting for a buffer (stage) wait here for an upload share given back or a part
        # initialised (on the memory book's lock).
        self._upload_changed = threading.Condition(memory.lock)

    def stage(self, part: VariablePart, wait_seconds: float | None = None) -> InitialUpload | None:
        """A private buffer for one upload of ``part``'s initial value; None when the part has its
        value already; MEMORY_LIMIT if the buffer does not fit.

        The first upload takes the bytes the create booked for it (the part's
        upload share). Another upload while that one runs (equal-array
        creators racing) books its own buffer; when that does not fit it
        waits, at most ``wait_seconds`` (None: :data:`UPLOAD_WAIT_SECONDS`),
        for the running upload to be installed (then None: this one is a
        duplicate) or dropped (then it takes the share), so that concurrent
        creators do not refuse each other. The buffer counts against the
        memory limit until the upload is installed, the part is initialised
        by another upload, or the upload is dropped (its ledger session
        forgotten).
        """
        nbytes = part.elements * part.spec.dtype.itemsize
        wait = UPLOAD_WAIT_SECONDS if wait_seconds is None else min(wait_seconds, UPLOAD_WAIT_SECONDS)
        deadline = time.monotonic() + wait
        with self._memory.lock:
            while True:
                self._memory.collect()
                if part.initialized:  # (a bool read) another upload was installed meanwhile
                    return None
                if part.share_free:
                    part.share_free = False
                    release: Callable[[int], None] = functools.partial(self._return_share, part)
                    break
                if self._memory.fits(nbytes):
                    self._memory.reserved += nbytes
                    release = self._release
                    break
                remaining = deadline - time.monotonic()
                # Another upload is running: it holds the share (also while it sets up) or a buffer.
                running = bool(part.upload_share and not part.share_free) or _uploading(part)
                if not running or remaining <= 0:
                    raise RequestError(
                        Reason.MEMORY_LIMIT,
                        f"uploading the initial value of {part.spec.name!r} needs a {nbytes}-byte buffer on "
                        f"shard {self._memory.shard_index}; {self._memory.in_use()} of the "
                        f"{self._memory.limit}-byte limit are in use (--max-memory-bytes)"
                        + ("; another upload of it is in progress" if running else ""))
                self._upload_changed.wait(remaining)
        try:
            upload = InitialUpload(part, nbytes, release)
        except MemoryError:
            release(nbytes)
            raise RequestError(Reason.MEMORY_LIMIT, f"out of memory allocating the {nbytes}-byte buffer for "
                                                    f"the initial value of {part.spec.name!r}") from None
        with part.lock:
            part.uploads.add(upload)
        return upload

    def _release(self, nbytes: int) -> None:
        with self._memory.lock:
            self._memory.reserved -= nbytes
            self._upload_changed.notify_all()  # an upload may wait for room (stage)

    def _return_share(self, part: VariablePart, nbytes: int) -> None:
        """The upload holding ``part``'s upload share was dropped: the share stays booked for the
        next upload while the part waits for its value and no other upload (with its own buffer)
        is in progress; otherwise it is given back. May run in a finalizer: takes no part's lock."""
        with self._memory.lock:
            if part.initialized or _uploading(part):
                part.upload_share = 0
                self._memory.reserved -= nbytes
            else:
                part.share_free = True
            self._upload_changed.notify_all()

    def _settle_share(self, part: VariablePart) -> None:
        """``part`` has its value: a share no upload holds is given back, and waiting uploads learn
        that they are duplicates."""
        with self._memory.lock:
            if part.share_free:
                part.share_free = False
                self._memory.reserved -= part.upload_share
                part.upload_share = 0
            self._upload_changed.notify_all()

    def install(self, upload: InitialUpload, spec_log: SpecRecorder | None) -> bool:
        """Make a complete upload the part's initial value, unless the part has one already.

        The value is written to the spec log first (when there is one), so
        that whoever sees the part initialised may rely on it surviving a
        crash. Returns True when this upload became the value.
        """
        part = upload.part
        with part.install_lock:  # racing uploads: the first one logged is the one installed
            buffer = upload.buffer  # read once: another upload's install may drop this one meanwhile
            if part.initialized or buffer is None:  # (a bool read: no lock needed)
                upload.drop()
                return False
            if spec_log is not None:
                spec_log.record_initial_value(part.spec, part.row_start, part.row_end, buffer)
            with self._gate.shared():
                with part.lock:
                    installed = not part.initialized  # (an install drops the others only after this)
                    if installed:
                        part.value = buffer
                        part.initialized = True
                    others = list(part.uploads)
                if installed:
                    self._changed()
        for other in others:  # every other upload of this part is now a duplicate
            other.drop()
        if installed:
            self._settle_share(part)
        return installed


def _uploading(part: VariablePart) -> bool:
    """Whether an upload of ``part``'s initial value still holds a buffer (read without the part's
    lock, which a finalizer calling this may not take; a stale answer only changes how long an
    upload waits, or whether a share is kept)."""
    return any(upload.buffer is not None for upload in list(part.uploads))
