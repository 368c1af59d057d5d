"""Copies, fills and comparisons of whole page pools, spread over the CPUs a run leaves idle.

A pool of gigabytes (the ``large-offset`` family: 4.3 GB per K and V) is filled with garbage
for each of a case's layouts, copied into the worker's arena for each call and compared back
after it: on one core, at 10-12 GB/s, that case took 107 s of a warm ``full`` run that was
otherwise over at 27 s. NumPy lets go of the GIL while it copies plain memory, and
``memcmp`` called through ctypes while it compares, so threads, each on its own range, share
the work; they are only used while the machine has CPUs to spare (``/proc/loadavg``), so a
busy parallel run stays one thread a process (but for the largest arrays: ``threads_for``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from conformance.polling import CPUS, runnable_tasks

BULK_BYTES = 1 << 26  # arrays from this size may be shared among threads
SLICE_BYTES = 1 << 24  # what one step of a thread handles
STAMP_BYTES = 1 << 21  # a repeated block is read in pieces of at least this (``_stamp``)
MAX_THREADS = 8
HUGE_BYTES = 1 << 30  # arrays from this size get ``HUGE_THREADS`` even on a busy machine
HUGE_THREADS = 4


def threads_for(nbytes: int) -> int:
    """How many threads to give work on ``nbytes``: one below ``BULK_BYTES``, else the CPUs
    that nothing runs on, this thread's own counted, at most ``MAX_THREADS``; from
    ``HUGE_BYTES``, at least ``HUGE_THREADS`` however busy the machine is.

    Arrays that large belong to a run's few largest cases, which start first and end last
    (``large-offset`` took 38 s in a warm ``full`` run whose other 506 cases were done by
    27 s, on one bulk thread while 15 workers were busy)."""
    if nbytes < BULK_BYTES or CPUS < 2:
        return 1
    running = runnable_tasks()
    idle = CPUS - running + 1 if running is not None else 1
    least = min(HUGE_THREADS, CPUS) if nbytes >= HUGE_BYTES else 1
    return max(least, min(MAX_THREADS, idle))


def copy_into(target: np.ndarray, source: np.ndarray) -> None:
    """``target[...] = source`` (the same shape and dtype); from the block of a sealed
    tiling where the pool repeats it; a large one only where ``target`` differs."""
    if not (_flat(target) and _flat(source)):
        target[...] = source
        return
    t, s = _bytes(target), _bytes(source)
    tiling = tiling_of(source)

    def part(start: int, end: int) -> None:
        pieces = tiling.pieces(s, start, end) if tiling else [(start, end, s[start:end])]
        for a, _, want in pieces:
            _overwrite(t, a, want)
    _shared(source.nbytes, part)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes (a NaN equals itself, -0.0 differs from 0.0).

    ``memcmp`` in slices, on the bulk threads: ``np.array_equal`` over bytes took 368 ms for
    100 MB and a temporary as large, over 64-bit words 15 ms, after every call of a long
    case; ``memcmp`` makes no temporary and is 1.2x faster again (2-core machine). Against a
    sealed ``tiled_pool``, the tiling's stamp stands in for the pool where it repeats."""
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes <= 1 << 16:  # most arrays of a call: block tables, lengths, small pools
        return a.tobytes() == b.tobytes()
    if tiling_of(a) is not None:
        a, b = b, a
    tiling = tiling_of(b)
    x = _bytes(np.ascontiguousarray(a))
    y = _bytes(np.ascontiguousarray(b))
    found = []

    def part(start: int, end: int) -> None:
        pieces = tiling.pieces(y, start, end) if tiling else [(start, end, y[start:end])]
        found.append(all(_memcmp(x[i:j].ctypes.data, want.ctypes.data, j - i) == 0
                         for i, j, want in pieces))
    _shared(x.size, part)
    return all(found)


def tile_into(target: np.ndarray, block: np.ndarray) -> None:
    """``target`` filled along its first axis with ``block`` over and over (the last copy
    cut short), ``block`` of ``target``'s shape but for fewer rows."""
    if not _flat(target):
        for start in range(0, target.shape[0], block.shape[0]):
            target[start:start + block.shape[0]] = block[:target.shape[0] - start]
        return
    t, stamp = _bytes(target), _stamp(block, target.nbytes)

    def part(start: int, end: int) -> None:
        while start < end:  # from ``start`` to the end of its copy of the stamp, or ``end``
            offset = start % stamp.size
            stop = min(end, start + stamp.size - offset)
            _overwrite(t, start, stamp[offset:offset + stop - start])
            start = stop
    _shared(target.nbytes, part)


def _overwrite(target: np.ndarray, start: int, want: np.ndarray) -> None:
    """``target[start:start + want.size] = want`` (bytes); from ``BULK_BYTES``, only if it
    holds something else.

    Reading is cheaper than writing, and where a pool is mostly garbage the bytes are often
    there already: in recycled memory that held the case's previous layout, in the arena
    slot that held its previous call. Bytes that differ are found at once (``memcmp`` stops
    at the first)."""
    end = start + want.size
    if target.size < BULK_BYTES or _memcmp(target[start:end].ctypes.data, want.ctypes.data,
                                            want.size) != 0:
        target[start:end] = want


def _stamp(block: np.ndarray, nbytes: int) -> np.ndarray:
    """``block``'s bytes repeated to ``STAMP_BYTES`` or more (no more than ``nbytes`` needs):
    what a fill or a comparison reads, in cache, in pieces large enough to be fast (a pool
    filled 32 KB at a time took 1.5x as long as from 2 MB pieces, 2-core machine)."""
    pattern = _bytes(np.ascontiguousarray(block))
    return np.tile(pattern, max(1, -(-min(STAMP_BYTES, nbytes) // max(1, pattern.size))))


# Within ``recycling()``: the byte buffers ``empty_pool`` handed out, to hand out again
_spare: list[np.ndarray] | None = None


@contextlib.contextmanager
def recycling() -> Iterator[None]:
    """Pools made by ``empty_pool`` within reuse the memory of earlier ones that nothing
    references any more; it is let go at the end.

    One case lays out its pool a dozen times or more (every relaid variant, the NaN problem,
    merge segments), each fresh allocation then faulted in page by page as it is filled: in
    ``large-offset``, 17 pools of 1 GB each took 37 of 60 s on a 2-core machine, nearly all
    of it the kernel's system time."""
    global _spare
    outer, _spare = _spare, []
    try:
        yield
    finally:
        _spare = outer


def empty_pool(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``; within ``recycling()`` a large one may be memory an earlier
    pool left (its old bytes still there: the caller fills it whole)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if _spare is None or nbytes < BULK_BYTES:
        return np.empty(shape, dtype)
    free = [i for i in range(len(_spare))
            if _spare[i].nbytes >= nbytes and _references(_spare, i) == _ALONE]
    if free:
        buffer = _spare[min(free, key=lambda i: _spare[i].nbytes)]
    else:  # to a power of two: the room costs address space, not memory (pages come as they
        # are written), and a later pool a little larger fits (a case's neighbours variant
        # is a page or two larger than its other layouts; GQA as MHA, its group size times)
        buffer = np.empty(1 << (nbytes - 1).bit_length(), np.uint8)
        _spare.append(buffer)
    return buffer[:nbytes].view(dtype).reshape(shape)


def _references(items: list, index: int) -> int:
    """References to ``items[index]``: a view of it or a pool made of it holds one more."""
    return sys.getrefcount(items[index])


_ALONE = _references([np.empty(0)], 0)  # held by its list alone (measured: Python may differ)


@dataclass(frozen=True)
class Tiling:
    """A pool that holds ``stamp`` (the bytes of a block of whole rows, repeated) over and
    over along its first axis, except perhaps in the rows ``written`` marks."""

    stamp: np.ndarray  # uint8
    row_bytes: int
    written: np.ndarray  # bool per row

    def pieces(self, pool: np.ndarray, start: int, end: int
               ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``[start, end)`` of the pool's bytes as ``(a, b, bytes it holds there)``: the
        stamp's (in cache) where no written row meets the piece, else the pool's own."""
        size = self.stamp.size
        while start < end:
            offset = start % size
            stop = min(end, start + size - offset)
            rows = self.written[start // self.row_bytes:(stop - 1) // self.row_bytes + 1]
            if rows.any():
                yield start, stop, pool[start:stop]
            else:
                yield start, stop, self.stamp[offset:offset + stop - start]
            start = stop


# Pools made by ``tiled_pool``: id -> (a weak reference to the pool, its tiling, sealed)
_tilings: dict[int, tuple[weakref.ref, Tiling, bool]] = {}


def tiled_pool(shape: tuple[int, ...], dtype: np.dtype, block: np.ndarray) -> np.ndarray:
    """A pool of ``shape`` (within ``recycling()``, maybe an earlier one's memory) holding
    ``block`` over and over along its first axis.

    Once its maker has written its own rows and sealed it (``seal_tiling``), ``copy_into``
    and ``same_bytes`` read the block, which stays in cache, wherever the pool repeats it,
    instead of the pool itself: a ``large-offset`` layout is a 4.3 GB pool per K and V, copied
    into the worker's arena and compared back after every call, with 20 pages of its own."""
    pool = empty_pool(shape, dtype)
    tile_into(pool, block)
    if pool.nbytes >= BULK_BYTES and shape[0]:
        key = id(pool)
        tiling = Tiling(_stamp(block, pool.nbytes), pool.nbytes // shape[0],
                         np.zeros(shape[0], bool))
        _tilings[key] = (weakref.ref(pool, lambda _: _tilings.pop(key, None)), tiling, False)
    return pool


def seal_tiling(pool: np.ndarray, rows: np.ndarray) -> None:
    """The maker of a ``tiled_pool`` wrote ``rows`` (indices along its first axis) and
    no others: from now on the pool is read-only, so that it stays what its tiling says. A
    pool most of whose rows were written, or not made by ``tiled_pool``, is left as it is."""
    entry = _tilings.get(id(pool))
    if entry is None or entry[0]() is not pool:
        return
    written = entry[1].written
    written[np.asarray(rows, dtype=np.int64)] = True
    if written.sum() * 4 > written.size:
        del _tilings[id(pool)]
        return
    pool.flags.writeable = False
    _tilings[id(pool)] = (entry[0], entry[1], True)


def tiling_of(array: np.ndarray) -> Tiling | None:
    """The tiling of a sealed ``tiled_pool`` (this very array, not a view of it)."""
    entry = _tilings.get(id(array))
    if entry is None or entry[0]() is not array or not entry[2]:
        return None
    return entry[1]


def _shared(nbytes: int, part: Callable[[int, int], None]) -> None:
    """``part(start, end)`` over ``[0, nbytes)`` in ``SLICE_BYTES`` steps, dealt out in
    turn to ``threads_for(nbytes)`` threads."""
    threads = threads_for(nbytes)
    steps = list(range(0, nbytes, SLICE_BYTES))

    def run(first: int) -> None:
        for start in steps[first::threads]:
            part(start, min(nbytes, start + SLICE_BYTES))
    if threads == 1 or len(steps) < 2:
        run(0)
        return
    list(_executor().map(run, range(threads)))


@functools.cache
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="conformance-bulk")


_memcmp = ctypes.CDLL(None).memcmp  # releases the GIL while it compares
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _flat(array: np.ndarray) -> bool:
    return array.flags.c_contiguous


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)
