"""Tiled pools across the arena: sent as their stamp and written rows, mapped back whole.

A sealed ``bulk.tiled_pool`` is one block of garbage repeated but for the rows its layout
wrote (``large-offset``: a 4.3 GB pool per K and V, 20 pages of its own). Copied into the
arena, compared back after each call and copied again by the worker on its way to the GPU,
each of its 17 layouts moved about 60 GB through host memory. Here the arena holds the stamp
once and the written rows after it; the worker maps the stamp over and over, and the rows
over it, into one address range (``mmap`` of the arena's file), so the backend reads a whole
pool that *is* the stamp and the rows: a write into a garbage page lands in the stamp, where
the harness sees it, and an upload can build the pool on the device from its parts
(``mapped_parts``) with no doubt that it is what the array holds.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from dataclasses import dataclass

import numpy as np

from conformance.bulk import same_bytes, tiling_of

PAGE = mmap.PAGESIZE
MAX_MAPPINGS = 1 << 14  # a pool that would need more maps of its stamp is copied instead
_MAP_FIXED = 0x10  # Linux (the arenas are memfds, Linux too); PROT_NONE is 0


@dataclass(frozen=True)
class Placement:
    """How a tiled pool lies in the arena: ``stamp_bytes`` of stamp, then the bytes of its
    written ``rows`` (sorted), ``row_bytes`` each."""

    stamp_bytes: int
    row_bytes: int
    rows: np.ndarray

    @property
    def packed_bytes(self) -> int:
        return self.stamp_bytes + self.rows.size * self.row_bytes


def placement(array: np.ndarray) -> Placement | None:
    """Where ``array`` is a sealed tiled pool whose stamp and rows fall on whole pages."""
    tiling = tiling_of(array)
    if tiling is None:
        return None
    stamp, row = tiling.stamp.size, tiling.row_bytes
    if stamp % PAGE or row % PAGE or array.nbytes % row or -(-array.nbytes // stamp) > \
            MAX_MAPPINGS:
        return None
    return Placement(stamp, row, np.flatnonzero(tiling.written))


def pack(region: np.ndarray, array: np.ndarray, place: Placement) -> None:
    """The stamp and written rows of ``array`` into ``region`` (bytes, ``packed_bytes``)."""
    region[:place.stamp_bytes] = tiling_of(array).stamp
    region[place.stamp_bytes:] = _rows(array, place).reshape(-1)


def same_packed(region: np.ndarray, array: np.ndarray, place: Placement) -> bool:
    """Whether ``region`` still holds what ``pack`` put there: then the pool mapped from it
    is ``array``, byte for byte."""
    return same_bytes(region[:place.stamp_bytes], tiling_of(array).stamp) and same_bytes(
        region[place.stamp_bytes:], _rows(array, place).reshape(-1))


def _rows(array: np.ndarray, place: Placement) -> np.ndarray:
    return array.reshape(-1).view(np.uint8).reshape(-1, place.row_bytes)[place.rows]


@dataclass(frozen=True)
class MappedParts:
    """What a mapped pool is made of, as views of the arena: ``stamp`` over and over, and
    ``rows`` (``(len(row_ids), row_bytes)``) at ``row_ids``."""

    nbytes: int
    stamp: np.ndarray
    row_ids: np.ndarray
    rows: np.ndarray


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long)
_munmap = _libc.munmap
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_FAILED = ctypes.c_void_p(-1).value

# start address of each mapped pool -> its parts (the entry goes when the pool is unmapped)
_mapped: dict[int, MappedParts] = {}


def map_pool(fd: int, arena: mmap.mmap, offset: int, place: Placement, nbytes: int
             ) -> np.ndarray:
    """The ``nbytes`` pool ``pack`` left at ``offset`` of the arena ``fd`` (mapped as
    ``arena``), as writable bytes; unmapped when the last view of it goes."""
    start = _map(None, nbytes, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    try:
        shared, rw = mmap.MAP_SHARED | _MAP_FIXED, mmap.PROT_READ | mmap.PROT_WRITE
        for at in range(0, nbytes, place.stamp_bytes):
            _map(start + at, min(place.stamp_bytes, nbytes - at), rw, shared, fd, offset)
        rows, first = place.rows, 0
        while first < rows.size:  # each run of consecutive rows in one map
            last = first
            while last + 1 < rows.size and rows[last + 1] == rows[last] + 1:
                last += 1
            _map(start + int(rows[first]) * place.row_bytes, (last - first + 1) * place.row_bytes,
                 rw, shared, fd, offset + place.stamp_bytes + first * place.row_bytes)
            first = last + 1
    except OSError:
        _munmap(start, nbytes)
        raise
    holder = (ctypes.c_uint8 * nbytes).from_address(start)
    stamp = np.frombuffer(arena, np.uint8, place.stamp_bytes, offset)
    packed_rows = np.frombuffer(arena, np.uint8, place.rows.size * place.row_bytes,
                                offset + place.stamp_bytes).reshape(-1, place.row_bytes)
    _mapped[start] = MappedParts(nbytes, stamp, place.rows, packed_rows)
    weakref.finalize(holder, _unmap, start, nbytes)
    return np.frombuffer(holder, np.uint8)


def mapped_parts(data: np.ndarray) -> MappedParts | None:
    """The parts of the pool ``data`` (its bytes, whole) when ``map_pool`` made it."""
    parts = _mapped.get(data.ctypes.data) if data.size else None
    if parts is None or data.nbytes != parts.nbytes or not data.flags.c_contiguous:
        return None
    return parts


def _map(address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _mmap(address, length, prot, flags, fd, offset)
    if got == _FAILED or (address is not None and got != address):
        raise OSError(ctypes.get_errno(), f"mmap of {length} bytes at arena offset {offset}")
    return got


def _unmap(start: int, nbytes: int) -> None:
    _mapped.pop(start, None)
    _munmap(start, nbytes)
