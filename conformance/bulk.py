"""Copies, fills and comparisons of whole page pools, spread over the CPUs a run leaves idle.

A pool of gigabytes (the ``large-offset`` family: 4.3 GB per K and V) is filled with garbage
for each of a case's layouts, copied into the worker's arena for each call and compared back
after it: on one core, at 10-12 GB/s, that case took 107 s of a warm ``full`` run that was
otherwise over at 27 s. NumPy lets go of the GIL while it copies or compares plain memory,
so threads, each on its own range, share the work; they are only used while the machine
has CPUs to spare (``/proc/loadavg``), so a busy parallel run stays one thread a process.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from conformance.polling import CPUS, runnable_tasks

BULK_BYTES = 1 << 26  # arrays from this size may be shared among threads
SLICE_BYTES = 1 << 24  # what one step of a thread handles (a comparison's temporary: a 64th)
MAX_THREADS = 8


def threads_for(nbytes: int) -> int:
    """How many threads to give work on ``nbytes``: one below ``BULK_BYTES``, else the CPUs
    that nothing runs on, this thread's own counted, at most ``MAX_THREADS``."""
    if nbytes < BULK_BYTES or CPUS < 2:
        return 1
    running = runnable_tasks()
    idle = CPUS - running + 1 if running is not None else 1
    return max(1, min(MAX_THREADS, idle))


def copy_into(target: np.ndarray, source: np.ndarray) -> None:
    """``target[...] = source`` (the same shape and dtype)."""
    if not (_flat(target) and _flat(source)):
        target[...] = source
        return
    t, s = _bytes(target), _bytes(source)

    def part(start: int, end: int) -> None:
        t[start:end] = s[start:end]
    _shared(source.nbytes, part)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes (a NaN equals itself, -0.0 differs from 0.0).

    Eight bytes at a time, in slices: ``np.array_equal`` over bytes took 368 ms for 100 MB
    and a temporary as large; as 64-bit words, 15 ms, after every call of a long case."""
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes <= 1 << 16:  # most arrays of a call: block tables, lengths, small pools
        return a.tobytes() == b.tobytes()
    x = _bytes(np.ascontiguousarray(a))
    y = _bytes(np.ascontiguousarray(b))
    words = x.size // 8 * 8
    found = []

    def part(start: int, end: int) -> None:
        found.append(np.array_equal(x[start:end].view(np.uint64), y[start:end].view(np.uint64)))
    _shared(words, part)
    return all(found) and np.array_equal(x[words:], y[words:])


def tile_into(target: np.ndarray, block: np.ndarray) -> None:
    """``target`` filled along its first axis with ``block`` over and over (the last copy
    cut short), ``block`` of ``target``'s shape but for fewer rows."""
    if not _flat(target):
        for start in range(0, target.shape[0], block.shape[0]):
            target[start:start + block.shape[0]] = block[:target.shape[0] - start]
        return
    t, pattern = _bytes(target), _bytes(np.ascontiguousarray(block))

    def part(start: int, end: int) -> None:
        while start < end:  # from ``start`` to the end of its copy of the block, or ``end``
            offset = start % pattern.size
            stop = min(end, start + pattern.size - offset)
            t[start:stop] = pattern[offset:offset + stop - start]
            start = stop
    _shared(target.nbytes, part)


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
    else:
        buffer = np.empty(nbytes, np.uint8)
        _spare.append(buffer)
    return buffer[:nbytes].view(dtype).reshape(shape)


def _references(items: list, index: int) -> int:
    """References to ``items[index]``: a view of it or a pool made of it holds one more."""
    return sys.getrefcount(items[index])


_ALONE = _references([np.empty(0)], 0)  # held by its list alone (measured: Python may differ)


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


def _flat(array: np.ndarray) -> bool:
    return array.flags.c_contiguous


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)
