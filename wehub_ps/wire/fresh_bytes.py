"""A new ``bytes`` object filled in place, so a message's tensor bytes are copied into it once.

gRPC Python sends ``bytes``. Joining pieces (``b"".join``) is one copy of
each tensor byte, but a payload that must first be gathered (rows of a
table in another order) would be copied twice: gathered into a temporary,
then joined. Here the rows are gathered straight into the message.

CPython's C API allows exactly this: a bytes object made by
``PyBytes_FromStringAndSize(NULL, size)`` has uninitialised contents that
its creator may write, through ``PyBytes_AsString``, until it shares the
object. :func:`filled_bytes` makes such an object and lends a writable
NumPy view of its contents to a fill function, before anyone else can see
it. Other Python implementations get a copy of a filled bytearray instead
(correct, one copy more).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import numpy as np

__all__ = ["filled_bytes"]


class _Contents:
    """Exposes a bytes object's contents to NumPy as a writable array; keeps the object alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: bytes, address: int, size: int) -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}


if sys.implementation.name == "cpython":
    _from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _from_size.restype = ctypes.py_object
    _from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _address = ctypes.pythonapi.PyBytes_AsString
    _address.restype = ctypes.c_void_p
    _address.argtypes = (ctypes.py_object,)

    def filled_bytes(size: int, fill: Callable[[np.ndarray], None]) -> bytes:
        """A new bytes object of ``size`` whose every byte ``fill`` writes into the uint8 array it is given.

        ``fill`` must not keep the array: once it returns, the bytes are
        immutable like any other.
        """
        if size <= 0:  # CPython shares its one empty bytes object: never write to it
            fill(np.empty(0, np.uint8))
            return b""
        owner = _from_size(None, size)
        fill(np.asarray(_Contents(owner, _address(owner), size)))
        return owner

else:  # pragma: no cover - exercised only on other interpreters
    def filled_bytes(size: int, fill: Callable[[np.ndarray], None]) -> bytes:
        """A new bytes object of ``size`` whose every byte ``fill`` writes into the uint8 array given."""
        scratch = bytearray(size)
        fill(np.frombuffer(scratch, np.uint8))
        return bytes(scratch)
