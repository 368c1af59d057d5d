"""Where the code under test runs: a worker process by default, this process when debugging.

A backend is untrusted code. ``IsolatedBackend`` hosts it in a child process of its own (its
stdout and stderr captured through a pipe, its calls over a socket); ``InProcessBackend``
calls it here, for debugging with a debugger. Both give the backend copies of its inputs, so
the harness keeps arrays the backend never touched, and both return plain NumPy arrays that
the harness validates before any check reads them.

Whatever the backend does in the worker (a signal, ``exit``, ``os._exit``, ``SystemExit``,
a hang, an out-of-memory kill) surfaces as ``BackendError`` on the call that held it; after
a fault the rest of that case fails fast and the next case gets a fresh worker.
"""

from __future__ import annotations

import copy
import fcntl
import os
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
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from backends.base import AttentionState, Backend, Capabilities, Conventions
from conformance.problem import Problem
from conformance.worker import (
    CALLS,
    BackendError,
    Captured,
    ContractError,
    describe_exception,
)

OUTPUT_TAIL = 4096  # bytes of a case's captured output kept for the report




def check_merged(backend_name: str, a: AttentionState, out: np.ndarray,
                 lse: np.ndarray) -> AttentionState:
    """The merged state, if its shapes and dtypes are the contract's; else the violation."""
    problems = []
    if out.shape != a.out.shape:
        problems.append(f"output shape {out.shape}, want {a.out.shape}")
    if out.dtype != a.out.dtype:
        problems.append(f"output dtype {out.dtype}, want {a.out.dtype}")
    if lse.shape != a.lse.shape:
        problems.append(f"lse shape {lse.shape}, want {a.lse.shape}")
    if lse.dtype != np.float32:
        problems.append(f"lse dtype {lse.dtype}, want float32")
    if problems:
        raise ContractError(f"{backend_name}'s merge returned a state with "
                                f"{'; '.join(problems)}")
    return AttentionState(out=out, lse=lse)


# --- handles: what the harness holds -----------------------------------------------------------


class BackendHandle:
    """The harness's view of one backend: its declared data, and calls that cannot hurt it."""

    def __init__(self, cls: type[Backend], label: str):
        self.cls = cls
        self.label = label
        self.capabilities: Capabilities = cls.capabilities
        self.conventions: Conventions = cls.conventions
        # the capabilities answer unless the class adds limits of its own (backend code)
        self._own_limits = cls.unsupported_reason is not Backend.unsupported_reason
        self._reasons: dict[str, str | None] = {}

    def call(self, name: str, *args: Any) -> Any:
        return self.submit(name, *args)()

    def submit(self, name: str, *args: Any) -> Callable[[], Any]:
        """Start a call; the returned function waits for its result (or raises its fault)."""
        raise NotImplementedError

    def submit_decode(self, problem: Problem, out: np.ndarray, lse: np.ndarray,
                      num_splits: int | None
                      ) -> Callable[[], tuple[np.ndarray, np.ndarray, tuple[str, ...]]]:
        """Start a decode; the harness may work (on the oracle, say) while it runs."""
        waiting = self.submit("decode", problem, out, lse, num_splits)

        def result() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
            got_out, got_lse, mutated = waiting()
            out[...], lse[...] = got_out, got_lse
            return out, lse, tuple(mutated)
        return result

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        out, lse = self.call("merge", a, b)
        return check_merged(self.label, a, out, lse)

    def unsupported_reason(self, case: Any) -> str | None:
        if not self._own_limits:
            return self.capabilities.unsupported_reason(case)
        if case.id not in self._reasons:
            self._reasons[case.id] = self.call("unsupported_reason", case)
        return self._reasons[case.id]

    def notes(self) -> list[str]:
        return []

    def device(self) -> str | None:
        """Where the backend runs ("cpu", "cuda"), asked once; None if it cannot say."""
        if not hasattr(self, "_device"):
            try:
                self._device = self.call("device")
            except (BackendError, ContractError):
                return None
        return self._device

    def begin_case(self, timeout: float | None) -> None:
        """Start the clock of a case; ``timeout`` None or 0 means none."""

    def end_case(self) -> Captured | None:
        """What the backend printed during the case (None when nothing or not captured)."""
        return None

    def close(self) -> None:
        pass


class InProcessBackend(BackendHandle):
    """The backend in this process (``--in-process``): for debuggers; no isolation, no timeout,
    no capture. It still gets copies of its inputs."""

    def __init__(self, cls: type[Backend], label: str):
        super().__init__(cls, label)
        self._instance: Backend | None = None

    @property
    def instance(self) -> Backend:
        if self._instance is None:
            try:
                self._instance = self.cls()
            except Exception as exc:
                raise BackendError(f"constructor raised {describe_exception(exc)}") from exc
        return self._instance

    def submit(self, name: str, *args: Any) -> Callable[[], Any]:
        instance = self.instance
        if name == "decode":  # the buffers are the backend's to write: copy only the problem
            args = (copy.deepcopy(args[0]), *args[1:])
        else:
            args = copy.deepcopy(args)
        try:
            result = CALLS[name](instance, *args)
        except ContractError:
            raise
        except Exception as exc:
            raise BackendError(f"{name} raised {describe_exception(exc)}") from exc
        return lambda: result

    def notes(self) -> list[str]:
        try:
            return self.call("notes") if self._instance is not None else []
        except BackendError as exc:
            return [str(exc)]


class IsolatedBackend(BackendHandle):
    """The backend in a worker process of its own, started on first use and after a fault."""

    def __init__(self, cls: type[Backend], label: str, target: str):
        super().__init__(cls, label)
        self.target = target
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.output: _OutputReader | None = None
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.fault: str = ""  # why the rest of this case fails fast
        self.unavailable: str = ""  # why every case fails fast
        self.busy = False  # a request is out: the worker may be stuck in it

    # - the worker's life -

    def _start(self) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conformance.worker", str(child.fileno())],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child.close()
        self.conn = Connection(parent.detach())
        self.output = _OutputReader(self.process.stdout)
        self._request(("open", self.target), "loading the backend")

    def _stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            if self.output is not None:
                self.output.join()
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None
        self.busy = False

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None and not self.busy:
            try:
                self.conn.send(None)
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop()

    # - cases -

    def begin_case(self, timeout: float | None) -> None:
        self.timeout = timeout or None
        self.deadline = time.monotonic() + timeout if timeout else None
        self.fault = ""
        if self.output is not None:
            self.output.take()

    def end_case(self) -> Captured | None:
        return self.output.take() if self.output is not None else None

    # - calls -

    def submit(self, name: str, *args: Any) -> Callable[[], Any]:
        if self.unavailable or self.fault:
            raise BackendError(self.unavailable or f"not run: {self.fault}")
        if self.process is None:
            self._start()
        return self._send(("call", name, args), name)

    def notes(self) -> list[str]:
        if self.process is None or self.fault or self.busy:
            return []
        try:
            return self.call("notes")
        except (BackendError, ContractError) as exc:
            return [f"notes() failed: {exc}"]

    def _request(self, message: tuple, what: str) -> Any:
        return self._send(message, what)()

    def _send(self, message: tuple, what: str) -> Callable[[], Any]:
        self.busy = True
        try:
            self.conn.send(message)
        except OSError:
            pass  # a dead worker: its exit status says more below
        return lambda: self._receive(what)

    def _receive(self, what: str) -> Any:
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            ready = self.conn.poll(remaining)
            reply = self.conn.recv() if ready else None
        except (EOFError, OSError):
            reply = ()
        self.busy = False
        if reply is None:
            self._fail(f"timed out after {self.timeout:g} s (in {what}); the worker was killed")
        if reply == ():
            self._fail(self._death(what))
        kind, value = reply
        if kind == "ok":
            return value
        if kind == "contract":
            raise ContractError(value)
        if kind == "unavailable":
            self.unavailable = f"backend {self.label} is unavailable in the worker process: {value}"
            self._fail(self.unavailable)
        raise BackendError(value)

    def _fail(self, why: str) -> None:
        self.fault = why
        self._stop()
        raise BackendError(why)

    def _death(self, what: str) -> str:
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.output.join()
        if code < 0:
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


