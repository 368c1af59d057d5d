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
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import AttentionState, Backend, Capabilities, Conventions
from conformance.problem import Problem, fingerprint

OUTPUT_TAIL = 4096  # bytes of a case's captured output kept for the report


class BackendError(Exception):
    """The backend raised, died, exited or ran out of time; the message says which."""


class ContractError(Exception):
    """The backend returned something the adapter contract does not allow: a failed check."""


@dataclass(frozen=True)
class Captured:
    """What a backend printed during one case: its length and its last bytes."""

    total_bytes: int
    tail: str

    def as_dict(self) -> dict:
        return {"bytes": self.total_bytes, "tail": self.tail}


PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def describe_exception(exc: BaseException) -> str:
    """The exception, where it was raised, and the last project frame on the way there."""
    if isinstance(exc, (BackendError, ContractError)):
        return str(exc)  # already said where and what
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno}"
        ours = [f for f in frames if f.filename.startswith(PROJECT_ROOT)]
        if ours and ours[-1] is not frames[-1]:
            where += f", from {ours[-1].filename}:{ours[-1].lineno}"
        where += ")"
    return f"{type(exc).__name__}: {exc}{where}"


# --- the calls, as run where the backend lives -------------------------------------------------


def call_decode(backend: Backend, problem: Problem, out: np.ndarray, lse: np.ndarray,
                num_splits: int | None) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Decode into the buffers; report which inputs the call changed."""
    before = fingerprint(problem.arrays())
    backend.decode(problem, out, lse, num_splits=num_splits)
    after = fingerprint(problem.arrays())
    return out, lse, tuple(name for name in before if before[name] != after[name])


def call_merge(backend: Backend, a: AttentionState, b: AttentionState
               ) -> tuple[np.ndarray, np.ndarray]:
    """The backend's merge, returned as plain arrays (never a class of the backend's own)."""
    inputs = {"a.out": a.out, "a.lse": a.lse, "b.out": b.out, "b.lse": b.lse}
    before = fingerprint(inputs)
    merged = backend.merge(a, b)
    changed = [name for name, digest in fingerprint(inputs).items() if digest != before[name]]
    if changed:
        raise ContractError(f"{type(backend).__name__}.merge modified its inputs: "
                                f"{', '.join(changed)}")
    if not isinstance(merged, AttentionState):
        raise ContractError(f"{type(backend).__name__}.merge returned "
                                f"{type(merged).__name__}, not an AttentionState")
    arrays = []
    for name in ("out", "lse"):
        value = getattr(merged, name)
        if not isinstance(value, np.ndarray) or value.dtype == object:
            raise ContractError(f"{type(backend).__name__}.merge returned a state whose "
                                    f"{name} is {type(value).__name__}"
                                    f"{'' if not isinstance(value, np.ndarray) else ' of objects'}"
                                    f", not a NumPy array")
        arrays.append(np.array(value, copy=True))
    return arrays[0], arrays[1]


def call_unsupported_reason(backend: Backend, case: Any) -> str | None:
    reason = backend.unsupported_reason(case)
    if reason is not None and not isinstance(reason, str):
        raise ContractError(f"unsupported_reason returned {reason!r}; want None or a string")
    return reason


def call_notes(backend: Backend) -> list[str]:
    return [str(note) for note in backend.notes()]


def call_bench(backend: Backend, label: str, shape: Any, rounds: int,
               copy_rate: float | None) -> Any:
    """Time a bench shape where the backend lives (timing must run beside the kernel)."""
    from conformance.bench import bench

    return bench(backend, label, shape, rounds, copy_rate)


def call_timing_device(backend: Backend) -> tuple[str, float | None, dict[str, str]]:
    """Where the backend's calls run; on a GPU, the copy rate and the GPU's name too."""
    device = backend.timing_device()
    if device != "cuda":
        return device, None, {}
    import torch

    from conformance.bench import copy_bandwidth

    return device, copy_bandwidth(), {"gpu": torch.cuda.get_device_name(0),
                                      "torch": torch.__version__}


def call_device(backend: Backend) -> str:
    return str(backend.timing_device())


CALLS: dict[str, Callable[..., Any]] = {
    "decode": call_decode, "merge": call_merge, "unsupported_reason": call_unsupported_reason,
    "notes": call_notes, "bench": call_bench, "timing_device": call_timing_device,
    "device": call_device,
}


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
            [sys.executable, "-m", "conformance.sandbox", str(child.fileno())],
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
        fd = self.stream.fileno()
        while chunk := os.read(fd, 65536):
            with self.lock:
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-OUTPUT_TAIL:]

    def take(self) -> Captured | None:
        with self.lock:
            total, tail, self.total, self.tail = self.total, self.tail, 0, b""
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


# --- the worker ----------------------------------------------------------------------------------


def _open(target: str) -> tuple[Backend | None, str]:
    from backends.registry import availability_reason, resolve

    cls = resolve(target)
    reason = availability_reason(cls)
    if reason:
        return None, reason
    try:
        return cls(), ""
    except Exception as exc:
        return None, f"constructor raised {describe_exception(exc)}"


def serve(conn: Connection) -> None:
    """Answer the harness's requests until it sends None or goes away."""
    backend: Backend | None = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        try:
            if message[0] == "open":
                backend, reason = _open(message[1])
                reply = ("unavailable", reason) if backend is None else ("ok", None)
            else:
                _, name, args = message
                reply = ("ok", CALLS[name](backend, *args))
        except ContractError as exc:
            reply = ("contract", str(exc))
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the case's fault
            what = message[1] if message[0] == "call" else "loading the backend"
            reply = ("raised", f"{what} raised {describe_exception(exc)}")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send(("raised", f"the result could not be sent back: "
                                 f"{describe_exception(exc)}"))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when a worker ends
    faulthandler.enable()  # a native crash prints the Python stack into the captured output
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
