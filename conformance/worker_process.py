"""The harness's side of a worker process: starting it, asking it, ending it with everything
it started, reading what it prints; and ``Probe``, loading a backend in one.

``conformance.worker`` is what runs inside; ``conformance.sandbox`` the backend handles built
on these.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

from conformance.backends.registry import UnknownBackendError
from conformance.declared import Declared
from conformance.plain_replies import decode_reply
from conformance.wire import (
    Arena,
    PeerGoneError,
    Segment,
    WireError,
    pack_message,
    receive_frame,
    send_frame,
)
from conformance.worker import Captured
from conformance.zygote import ForkedProcess, forked_worker, worker_environment

OUTPUT_TAIL = 4096  # bytes of a case's captured output kept for the report
DEPTH = 2  # requests a worker may have out at once (Worker.send)


class Worker:
    """One worker process: started, asked, and ended with everything it started.

    It runs in a session (and process group) of its own, so that a Ctrl-C reaches the harness
    only and so that ending it ends the helpers it forked too. Its death is read from its exit
    status (a pidfd wakes the wait), never from the end of a pipe a forked child may hold.
    With a ``target`` whose zygote serves this run it is forked from there by ``deadline``
    (``conformance.zygote``), else spawned."""

    def __init__(self, target: str | None = None, deadline: float | None = None) -> None:
        parent, child = socket.socketpair()
        env = worker_environment()
        self.process: subprocess.Popen | ForkedProcess | None = (  # from its zygote
            forked_worker(target, child, env, deadline) if target else None)
        if self.process is None:
            if target:  # a zygote that forks after all, late, serves a channel closed here
                parent.close()
                child.close()
                parent, child = socket.socketpair()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "conformance.worker", str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child.close()
        self.sock = parent
        try:
            self.pidfd: int | None = os.pidfd_open(self.process.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        self.output = _OutputReader(self.process.stdout)
        self.number = 0  # the last request's: its reply must carry it
        self.arenas: list[Arena | None] = [None] * DEPTH  # the shared memory the worker maps
        self.out: dict[int, int] = {}  # requests sent and not answered: number -> arena slot
        self.early: dict[int, list] = {}  # replies read while waiting for an older one

    def send(self, message: Any, deadline: float | None) -> Segment:
        """Send a request; its arrays go in a shared segment the harness keeps. Up to
        ``DEPTH`` requests may be out: the worker answers them in order, so the harness lays
        out the next while the backend works on this one. An OSError means the worker is gone
        (its exit status says more) or stopped reading."""
        if len(self.out) >= DEPTH:
            raise RuntimeError(f"{DEPTH} requests are out already")
        self.number = secrets.randbits(62)  # unguessable: a forged reply cannot match it
        slot = next(s for s in range(DEPTH) if s not in self.out.values())
        arena = self.arenas[slot]
        largest = max((a.size for a in self.arenas if a is not None), default=0)
        payload, segment = pack_message((self.number, message), arena, slot, largest)
        fresh = segment.arena if segment.arena is not arena else None
        self.out[self.number] = slot
        try:
            self.sock.settimeout(None if deadline is None
                                 else max(0.001, deadline - time.monotonic()))
            send_frame(self.sock, payload, (fresh.fd,) if fresh else ())
        finally:
            self.sock.settimeout(None)
            if fresh:  # the worker maps it on receipt; an arena it never got is not reused
                fresh.close_fd()
        if fresh:
            self.arenas[slot] = fresh
        return segment

    def receive(self, deadline: float | None, number: int | None = None) -> list | None:
        """The reply to request ``number`` (the last one sent by default), as [kind, value,
        lost]; None past the deadline.

        Replies to other requests still out are kept for their turn; frames of other numbers
        (a backend that wrote to the channel itself) are dropped. ``PeerGoneError``: the
        worker ended; ``WireError``: it broke the protocol."""
        number = self.number if number is None else number
        if number not in self.out:
            raise RuntimeError(f"no request {number} is out to this worker")
        while number not in self.early:
            frame = receive_frame(self.sock, deadline, self.exited, self.pidfd)
            if frame is None:
                return None
            try:
                reply = decode_reply(frame)
            except WireError as exc:
                raise WireError(f"a reply that is not data: {exc}") from None
            if not (isinstance(reply, list) and len(reply) == 4 and isinstance(reply[0], int)
                    and reply[1] in ("ok", "contract", "unavailable", "raised")):
                raise WireError(f"a reply that is not [number, kind, value, lost]: "
                                f"{str(reply)[:120]}")
            if reply[0] in self.out:
                self.early[reply[0]] = reply[1:]
        self.out.pop(number, None)
        return self.early.pop(number)

    @property
    def waiting(self) -> bool:
        """Whether a request is out: the worker may be working on it, or stuck in it."""
        return bool(self.out)

    def wrote_unasked(self) -> bool:
        """Whether bytes wait on the channel while no request is out: the worker wrote on its
        own. (While one is out, its reply may be there already.)"""
        return not self.out and bool(select.select([self.sock], [], [], 0)[0])

    def exited(self) -> bool:
        """Whether the worker has ended, looked at without reaping it (its process group id
        stays reserved until it is reaped, so ending the group then cannot hit another)."""
        if isinstance(self.process, ForkedProcess):
            return self.process.exited()
        try:
            return os.waitid(os.P_PID, self.process.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def exit_status(self, wait: float) -> int | None:
        """Its exit status, waiting up to ``wait`` seconds before killing it (None: a forked
        worker whose zygote ended first)."""
        deadline = time.monotonic() + wait
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.end()
        return self.process.returncode

    def end(self) -> None:
        """Kill the worker and every process of its group, then reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.output.join()
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def close(self, wait: float = 5.0) -> None:
        """Ask the worker to end, give it ``wait`` seconds, then end what is left."""
        try:
            self.sock.settimeout(wait)
            send_frame(self.sock, pack_message(None)[0])  # the worker's cue to end
        except OSError:
            pass
        self.exit_status(wait)

    def death(self, what: str) -> str:
        """Why the worker ended, from its exit status and its last output."""
        code = self.exit_status(10.0)
        if code is None:
            how = "ended (its exit status went with the zygote that forked it)"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if code == -signal.SIGKILL:
                how += " (out of memory, or killed from outside)"
        else:
            how = f"exited with status {code}"
        last = self.output.last_lines()
        return f"the worker process {how} during {what}" + (f"; its last output: {last}"
                                                            if last else "")


# Workers started by ``open_ahead``, by target, until a handle in this process takes one.
_AHEAD: dict[str, Worker] = {}


def open_ahead(target: str) -> Callable[[], None]:
    """Start a worker opening ``target`` now, its reply unread, for the first handle of that
    target in this process (``take_ahead``): a pool's workers load the backend while the
    harness's probe still does. Returns what ends it if no handle took it."""
    worker = Worker(target)
    try:
        worker.send(("open", target), None)
    except OSError:  # gone at once: the handle starts its own and reports why
        worker.end()
        return lambda: None
    _AHEAD[target] = worker

    def end_if_unused() -> None:
        if _AHEAD.get(target) is worker:
            del _AHEAD[target]
            worker.end()
    return end_if_unused


def take_ahead(target: str) -> Worker | None:
    """The worker ``open_ahead`` started for ``target``, its open request still out."""
    return _AHEAD.pop(target, None)


class Probe:
    """Loading a backend in a worker of its own: started at once, read with ``result``, so
    that several backends load side by side (each importing torch, say, takes seconds).

    A backend that fails to import is refused (``UnknownBackendError``, a one-line error); one
    whose import or availability check kills or hangs its worker is unavailable, with why."""

    def __init__(self, target: str, timeout: float | None):
        self.target, self.timeout = target, timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.worker = Worker(target, self.deadline)
        self.sent: OSError | None = None
        try:
            self.worker.send(("describe", target), self.deadline)
        except OSError as exc:
            self.sent = exc

    def result(self) -> Declared:
        worker, target = self.worker, self.target
        try:
            if self.sent is not None:
                raise self.sent
            reply = worker.receive(self.deadline)
        except (OSError, PeerGoneError):
            return Declared.unloadable(target, "loading it: " + worker.death("loading the "
                                                                            "backend"))
        except WireError as exc:
            worker.end()
            return Declared.unloadable(target, f"loading it broke the protocol: {exc}")
        if reply is None:
            worker.end()
            return Declared.unloadable(target, f"loading it timed out after {self.timeout:g} s "
                                               f"(its import or availability check); it was "
                                               f"killed")
        # Ended beside the run, not before it: a worker that imported torch takes 0.4 s (CPU)
        # to exit, time the pool's workers can spend loading. A thread the interpreter waits
        # for, so a worker slow to exit is still killed after close's grace period.
        threading.Thread(target=worker.close, name=f"closing probe {target}").start()
        kind, value, _ = reply
        if kind != "ok":
            raise UnknownBackendError(str(value))
        return Declared.from_data(value, target)


class _OutputReader:
    """Drains a worker's stdout+stderr in a thread, keeping the count and the last bytes."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()
        self.total = 0
        self.tail = b""
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        """Read what is in the pipe under the lock, so that ``take`` after a reply (the worker
        flushes before replying) sees every byte of the case it closes."""
        try:
            self._read_until_closed(self.stream.fileno())
        except (OSError, ValueError):  # the pipe was closed under us (a worker's child kept
            pass                       # it open past the worker's death)

    def _read_until_closed(self, fd: int) -> None:
        while True:
            select.select([fd], [], [])
            with self.lock:
                waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                chunk = os.read(fd, max(waiting, 1) if waiting < 1 << 20 else 1 << 20)
                if not chunk:
                    return  # the worker is gone
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-OUTPUT_TAIL:]

    def take(self) -> Captured | None:
        deadline = time.monotonic() + 2.0
        while True:  # let the thread drain what the worker wrote before its reply
            with self.lock:
                try:
                    waiting = struct.unpack("i", fcntl.ioctl(
                        self.stream.fileno(), termios.FIONREAD, b"\0" * 4))[0]
                except (OSError, ValueError):  # the worker is gone and its pipe closed
                    waiting = 0
                if not waiting or time.monotonic() > deadline:
                    total, tail, self.total, self.tail = self.total, self.tail, 0, b""
                    break
            time.sleep(0.001)
        return Captured(total, tail.decode("utf-8", "replace")) if total else None

    def last_lines(self, count: int = 5) -> str:
        """The last lines printed; for a fatal signal, Python's line for it and the frame
        that was running (faulthandler prints that first)."""
        with self.lock:
            lines = [line.strip() for line in self.tail.decode("utf-8", "replace").splitlines()
                     if line.strip()]
        fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python")), None)
        if fatal is not None:
            frame = next((line for line in lines[fatal:] if line.startswith("File ")), "")
            return " | ".join(line for line in (lines[fatal], frame) if line)
        return " | ".join(lines[-count:])

    def join(self) -> None:
        self.thread.join(timeout=5)
        self.stream.close()


