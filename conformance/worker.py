"""What runs in a backend's worker process: the calls the harness may make, and the loop that
serves them (``python -m conformance.worker FD``, started by ``conformance.sandbox``).

Each call runs the backend on the arguments it was sent (copies the harness keeps no hold
of) and returns plain data; whatever the backend raises, ``SystemExit`` and
``KeyboardInterrupt`` included, goes back as a described fault.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import AttentionState, Backend
from conformance.problem import Problem, fingerprint


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
        _flush_output()
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send(("raised", f"the result could not be sent back: "
                                 f"{describe_exception(exc)}"))


def _flush_output() -> None:
    """Everything the call printed, Python's buffers and C's, goes out before the reply."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when a worker ends
    faulthandler.enable()  # a native crash prints the Python stack into the captured output
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
