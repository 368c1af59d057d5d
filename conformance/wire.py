"""The channel between the harness and a backend's worker process.

Harness to worker: a pickle (the harness is the trusted side) whose arrays travel in shared
memory: an arena the worker maps once (handed over as a file descriptor) and each request
reuses. After the call the harness reads the outputs the backend wrote there and compares the
inputs it handed over with its own copies, byte for byte: purity is the harness's own
observation, not the worker's word.

Worker to harness: data only (``conformance.plain_replies``). Nothing a backend sends is
executed or unpickled, so it can neither run code in the harness nor forge a verdict.

Frames are an 8-byte length and that many bytes. The harness reads a reply against a
deadline and watches the worker's exit at the same time, so a reply that starts and stops, or
a worker that dies while a forked child keeps the socket open, cannot hold it.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance import tiled_arena
from conformance.bulk import copy_into, same_bytes
from conformance.polling import poll_readable, poll_seconds, readable

HEADER = struct.Struct("!Q")
MAX_REPLY_BYTES = 1 << 31  # no reply of the contract comes near; a larger length is a lie
ALIGN = 64  # bytes: each array in a segment starts on a cache line


class WireError(Exception):
    """A frame that is not what the protocol allows; the message says what was wrong."""


class PeerGoneError(Exception):
    """The other side closed the channel or its process ended before a whole frame came."""


# --- frames ------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, payload: bytes, fds: tuple[int, ...] = ()) -> None:
    """One frame; ``fds`` travel with its first byte (SCM_RIGHTS)."""
    data = HEADER.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    sock.sendall(memoryview(data)[sent:])


def receive_frame_blocking(sock: socket.socket, max_fds: int = 4
                           ) -> tuple[bytes, list[int]] | None:
    """The worker's side: the next frame and the descriptors that came with it, or None at
    end of stream."""
    poll_readable(sock, poll_seconds())
    head, fds, _, _ = socket.recv_fds(sock, HEADER.size, max_fds)
    if not head:
        return None
    head += _read_exactly(sock, HEADER.size - len(head))
    (length,) = HEADER.unpack(head)
    return _read_exactly(sock, length), fds


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 22))
        if not chunk:
            raise PeerGoneError("end of stream inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive_frame(sock: socket.socket, deadline: float | None, exited: Callable[[], bool],
                  process_fd: int | None = None) -> bytes | None:
    """The harness's side: a whole frame, or None when ``deadline`` (monotonic) passes first.

    ``exited`` says whether the worker has ended; ``process_fd`` (a pidfd), when given, wakes
    the wait the moment it does. Raises ``PeerGoneError`` when the worker ended or closed the
    channel before a whole frame arrived, ``WireError`` for a length past the limit."""
    sock.setblocking(False)
    buffer = bytearray()
    wanted = HEADER.size
    have_length = False
    watched = [sock] if process_fd is None else [sock, process_fd]
    try:
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return None
            # without a pidfd, look at the worker's exit status every 50 ms
            step = timeout if process_fd is not None else min(timeout or 0.05, 0.05)
            polled = poll_readable(sock, min(poll_seconds(), 1 if step is None else step))
            ready = [sock] if polled else select.select(watched, [], [], step)[0]
            if sock in ready:
                try:
                    chunk = sock.recv(min(wanted - len(buffer), 1 << 22))
                except BlockingIOError:
                    continue
                if not chunk:
                    raise PeerGoneError("the worker closed its end of the channel")
                buffer += chunk
                if len(buffer) == wanted:
                    if have_length:
                        return bytes(buffer[HEADER.size:])
                    (length,) = HEADER.unpack(buffer)
                    if length > MAX_REPLY_BYTES:
                        raise WireError(f"a reply of {length} bytes announced (the limit is "
                                        f"{MAX_REPLY_BYTES})")
                    have_length, wanted = True, HEADER.size + length
                    if length == 0:
                        return b""
                continue
            if exited() and not readable(sock):
                raise PeerGoneError("the worker ended")
    finally:
        sock.setblocking(True)


# --- harness to worker: a pickle with its arrays in shared memory -----------------------------


ARENA_MIN_BYTES = 1 << 20
ARENA_SHRINK_BYTES = 1 << 26  # an arena past this is given back when messages need an eighth
ARENA_SHRINK_AFTER = 16  # ... this many of them in a row


class Arena:
    """Shared memory that one worker maps once and every request reuses.

    A fresh segment per call cost a ``memfd``, a mapping on each side and a page fault per
    page on each side, every call: 6 s of system time in a NumPy ``ci`` run. An arena is
    replaced only to grow, or to give back a large one that messages no longer need.

    A worker holds one arena per ``slot``: a request may be sent while the one before it is
    still out (``Worker.send``), and the two must not share memory."""

    def __init__(self, size: int, slot: int = 0):
        self.slot = slot
        self.size = max(ARENA_MIN_BYTES, 1 << max(0, size - 1).bit_length())
        self.fd = os.memfd_create("conformance-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.generation = 0  # the placement whose views are valid
        self.underused = 0  # messages in a row that needed less than an eighth of a large arena

    def takes(self, size: int) -> bool:
        """Whether the next message, of ``size`` bytes, goes here.

        A large arena is given back only after ``ARENA_SHRINK_AFTER`` small messages in a
        row: a case's small calls between its large ones (merges, notes) replaced it at once
        and the next large call paid the fresh arena's page faults again, 3 s per GB on a
        2-core machine, a few times in every ``large-offset`` case."""
        if size > self.size:
            return False
        if self.size > ARENA_SHRINK_BYTES and size * 8 < self.size:
            self.underused += 1
            return self.underused < ARENA_SHRINK_AFTER
        self.underused = 0
        return True

    def close_fd(self) -> None:
        """Once the worker holds the arena, the harness needs only its mapping."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Segment:
    """The arrays of one message, copied into an arena the worker maps.

    ``view(i)`` is array ``i`` as it lies in the arena now (what the backend left there),
    ``originals[i]`` the harness's own array it was copied from. The views are valid until the
    next message is placed in the same arena (its slot is free once the reply came). A sealed
    tiled pool lies there as its stamp and written rows (``conformance.tiled_arena``): it has
    no view here, and ``changed`` compares those."""

    def __init__(self, arrays: list[np.ndarray], arena: Arena | None):
        self.originals = arrays
        self.arena = arena
        self.layout = _layout(arrays)
        if arena is None:
            self.views: list[np.ndarray] = []
            return
        arena.generation += 1
        self.generation = arena.generation
        self.views = [view_in(arena.map, *place) for place in self.layout]
        for view, array, place in zip(self.views, arrays, self.layout, strict=True):
            if len(place) > 3:
                tiled_arena.pack(view, array, place[3])
            else:
                copy_into(view, array)

    def view(self, index: int) -> np.ndarray:
        if len(self.layout[index]) > 3:
            raise ValueError("a tiled pool travels as its parts: it has no view in the harness")
        return self._placed(index)

    def changed(self, index: int) -> bool:
        """Whether array ``index`` differs, byte for byte, from the harness's own."""
        if len(self.layout[index]) > 3:
            return not tiled_arena.same_packed(self._placed(index), self.originals[index],
                                               self.layout[index][3])
        return not same_bytes(self.view(index), self.originals[index])

    def _placed(self, index: int) -> np.ndarray:
        if self.arena.generation != self.generation:
            raise RuntimeError("a segment read after the next message reused its arena")
        return self.views[index]


# where each array lies: (offset, dtype, shape), and for a tiled pool its ``Placement``
Place = tuple


def _layout(arrays: list[np.ndarray]) -> list[Place]:
    layout, size = [], 0
    for array in arrays:
        tiled = tiled_arena.placement(array)
        align = ALIGN if tiled is None else tiled_arena.PAGE  # a map starts on a page
        size = -(-size // align) * align
        layout.append((size, array.dtype, array.shape) if tiled is None
                      else (size, array.dtype, array.shape, tiled))
        size += array.nbytes if tiled is None else tiled.packed_bytes
    return layout


def _extent(layout: list[Place]) -> int:
    return max((place[0] + _bytes_of(place) for place in layout), default=0)


def _bytes_of(place: Place) -> int:
    """What an array takes in the arena: its bytes, or a tiled pool's parts."""
    if len(place) > 3:
        return place[3].packed_bytes
    _, dtype, shape = place
    return math.prod(shape) * np.dtype(dtype).itemsize


def view_in(buffer: Any, offset: int, dtype: np.dtype, shape: tuple[int, ...],
            tiled: tiled_arena.Placement | None = None) -> np.ndarray:
    """The array at ``offset`` of ``buffer``; for a tiled pool, its parts' bytes."""
    if tiled is not None:
        return np.frombuffer(buffer, dtype=np.uint8, count=tiled.packed_bytes, offset=offset)
    count = math.prod(shape)
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)


class _SharingPickler(pickle.Pickler):
    def __init__(self, stream: io.BytesIO):
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self.seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.dtype != object:
            if id(obj) not in self.seen:
                self.seen[id(obj)] = len(self.arrays)
                self.arrays.append(obj)
            return self.seen[id(obj)]
        return None


def pack_message(message: Any, arena: Arena | None = None, slot: int = 0, like: int = 0
                 ) -> tuple[bytes, Segment]:
    """A message as a pickle whose arrays lie in ``arena``, or in a new arena of ``slot`` when
    it is missing or does not fit (``segment.arena`` then differs: its descriptor goes with
    the message). A message without arrays uses no arena.

    A new arena is at least ``like`` bytes (the worker's largest) unless the message needs
    less than an eighth of that: a large case's calls grow both slots, and a slot grown one
    call at a time (128, 256, 512 MiB) faulted in the pages of each; unwritten room costs
    address space, not memory."""
    stream = io.BytesIO()
    pickler = _SharingPickler(stream)
    pickler.dump(message)
    layout = _layout(pickler.arrays)
    slot = arena.slot if arena is not None else slot
    extent = _extent(layout)
    if pickler.arrays and (arena is None or not arena.takes(extent)):
        arena = Arena(max(extent, like) if extent * 8 >= like else extent, slot)
    segment = Segment(pickler.arrays, arena if pickler.arrays else None)
    header = pickle.dumps((slot, segment.layout), protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(header)) + header + stream.getvalue(), segment


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, arrays: list[np.ndarray]):
        super().__init__(stream)
        self.arrays = arrays

    def persistent_load(self, pid: Any) -> np.ndarray:
        return self.arrays[pid]


class Mapped:
    """The worker's side of the arenas: the mapping (and file) of the last one the harness
    sent for each slot."""

    def __init__(self) -> None:
        self.maps: dict[int, mmap.mmap] = {}
        self.fds: dict[int, int] = {}  # kept: a tiled pool is mapped from the file

    def unpack(self, payload: bytes, fd: int | None) -> Any:
        """The message ``pack_message`` made; its arrays are writable views of the arena.
        ``fd``, when given, is a new arena that replaces the old one of its slot."""
        (length,) = HEADER.unpack_from(payload)
        slot, layout = pickle.loads(payload[HEADER.size:HEADER.size + length])
        if fd is not None:
            self.maps[slot] = mmap.mmap(fd, os.fstat(fd).st_size)
            if slot in self.fds:
                os.close(self.fds[slot])
            self.fds[slot] = fd
        arrays = [self._array(slot, place) for place in layout] if layout else []
        stream = io.BytesIO(payload[HEADER.size + length:])
        return _SharingUnpickler(stream, arrays).load()

    def _array(self, slot: int, place: Place) -> np.ndarray:
        if len(place) == 3:
            return view_in(self.maps[slot], *place)
        offset, dtype, shape, tiled = place
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        pool = tiled_arena.map_pool(self.fds[slot], self.maps[slot], offset, tiled, nbytes)
        return pool.view(dtype).reshape(shape)


def unpack_message(payload: bytes, fd: int | None) -> Any:
    """One message on its own (a fresh worker side): for tests and one-off readers."""
    return Mapped().unpack(payload, fd)
