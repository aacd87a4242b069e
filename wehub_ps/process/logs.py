"""Structured logs: one JSON object per line, one line per event.

Processes of this project (ps-server, ps-local) call :func:`configure`
once; library code only logs, with the event's fields in
``extra={"fields": {...}}``, and never configures handlers.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["JsonFormatter", "Throttled", "configure", "event"]


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "event": ..., <fields>}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    """Route every logger's records to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # gRPC's own Python logger is chatty about things we report ourselves.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))


def event(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log one event with structured fields."""
    logger.log(level, message, extra={"fields": fields})


class Throttled:
    """An event that may repeat many times a second, logged at most once per ``interval`` seconds.

    Each line that is logged says, in ``repeated``, how many were held back
    since the previous one, so a reader still sees how often it happened.
    """

    def __init__(self, logger: logging.Logger, level: int, message: str, interval: float = 5.0) -> None:
        self._logger = logger
        self._level = level
        self._message = message
        self._interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held_back = 0

    def __call__(self, **fields: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval:
                self._held_back += 1
                return
            repeated, self._held_back, self._last = self._held_back, 0, now
        if repeated:
            fields["repeated"] = repeated
        event(self._logger, self._level, self._message, **fields)
