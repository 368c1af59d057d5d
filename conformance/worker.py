"""What runs in a backend's worker process: the calls the harness may make, and the loop that
serves them (``python -m conformance.worker FD``, started by ``conformance.sandbox``).

Each call runs the backend on the arguments it was sent (views of a shared segment that the
harness compares with its own copies afterwards) and returns plain data (``conformance.wire``);
whatever the backend raises, ``SystemExit`` and ``KeyboardInterrupt`` included, goes back as
a described fault, with a word on whether the device context survived it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conformance.backends.base import AttentionState, Backend
from conformance.plain_replies import encode_reply
from conformance.problem import Problem
from conformance.profiling import profiled
from conformance.wire import Mapped, receive_frame_blocking, send_frame


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
                num_splits: int | None) -> None:
    """Decode into the buffers. The harness reads them, and compares the inputs it handed
    over with its own copies, itself: nothing here reports on purity."""
    backend.decode(problem, out, lse, num_splits=num_splits)


def call_merge(backend: Backend, a: AttentionState, b: AttentionState) -> dict:
    """The backend's merge, returned as plain arrays (never a class of the backend's own)."""
    merged = backend.merge(a, b)
    if not isinstance(merged, AttentionState):
        raise ContractError(f"{type(backend).__name__}.merge returned "
                            f"{type(merged).__name__}, not an AttentionState")
    arrays = {}
    for name in ("out", "lse"):
        value = getattr(merged, name)
        if not isinstance(value, np.ndarray) or value.dtype == object:
            raise ContractError(f"{type(backend).__name__}.merge returned a state whose "
                                f"{name} is {type(value).__name__}"
                                f"{'' if not isinstance(value, np.ndarray) else ' of objects'}"
                                f", not a NumPy array")
        arrays[name] = value
    return arrays


def call_merges(backend: Backend, pairs: list[tuple[AttentionState, AttentionState]]
                ) -> list[list]:
    """Independent merges in one request, each with the reply a call of its own would have
    had; a merge that loses the device ends the list (the harness sends the rest to a fresh
    worker). One round trip for a check's merges rather than one for each."""
    replies = []
    for a, b in pairs:
        replies.append(_outcome("merge", lambda a=a, b=b: call_merge(backend, a, b)))
        if replies[-1][2]:
            break
    return replies


def call_unsupported_reason(backend: Backend, case: Any) -> str | None:
    reason = backend.unsupported_reason(case)
    if reason is not None and not isinstance(reason, str):
        raise ContractError(f"unsupported_reason returned {reason!r}; want None or a string")
    return reason


def call_notes(backend: Backend) -> list[str]:
    return [str(note) for note in backend.notes()]


def call_bench(backend: Backend, label: str, shape: Any, rounds: int,
               copy_rate: float | None) -> dict:
    """Time a bench shape where the backend lives (timing must run beside the kernel)."""
    from dataclasses import asdict

    from conformance.bench import bench

    return asdict(bench(backend, label, shape, rounds, copy_rate))


def call_timing_device(backend: Backend) -> list:
    """Where the backend's calls run; on a GPU, the copy rate and the GPU's name too."""
    device = backend.timing_device()
    if device != "cuda":
        return [device, None, {}]
    import torch

    from conformance.bench import copy_bandwidth

    return [device, copy_bandwidth(), {"gpu": torch.cuda.get_device_name(0),
                                       "torch": torch.__version__}]


def call_device(backend: Backend) -> str:
    return str(backend.timing_device())


CALLS: dict[str, Callable[..., Any]] = {
    "decode": call_decode, "merges": call_merges, "unsupported_reason": call_unsupported_reason,
    "notes": call_notes, "bench": call_bench, "timing_device": call_timing_device,
    "device": call_device,
}

# What an error says when the device context it ran in is gone for good: CUDA's sticky
# errors, as CUDA, PyTorch, Triton, TVM and FlashInfer word them. After one, every later call
# in that process fails, so the worker must be replaced.
DEVICE_LOST = ("illegal memory access", "illegal address", "unspecified launch failure",
               "device-side assert", "misaligned address", "illegal instruction",
               "cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED", "hardware stack error",
               "uncorrectable ECC error", "AcceleratorError")


def device_lost(text: str) -> str | None:
    """The words of ``text`` that say the device context is lost, or None."""
    lowered = text.lower()
    found = next((words for words in DEVICE_LOST if words.lower() in lowered), None)
    return f"the device context is lost ({found!r} in the error)" if found else None


def device_health() -> str | None:
    """After an error: None when the GPU this process uses still works (synchronise,
    allocate, compute, copy back), else why not. Nothing to probe without CUDA in use.

    A launch error that is not sticky (an invalid launch configuration) stays pending until
    the next call asks for it, so the first probe can report the backend's own error: only a
    second failure means the device is gone. FlashInfer's ``merge_state`` at 128 heads of 512
    left such an error, and every merge replaced the worker (docs/gpu-results.md)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    failure = None
    for _ in range(2):
        try:
            torch.cuda.synchronize()
            probe = torch.ones(4, device="cuda") + 1
            if float(probe.sum().cpu()) != 8.0:
                return "the device health probe computed a wrong sum"
            return None
        except BaseException as exc:
            failure = f"the device health probe failed: {type(exc).__name__}: {str(exc)[:200]}"
    return failure


def _open(target: str) -> tuple[Backend | None, str]:
    from conformance.backends.registry import availability_reason, resolve

    cls = resolve(target)
    reason = availability_reason(cls)
    if reason:
        return None, reason
    try:
        return cls(), ""
    except Exception as exc:
        return None, f"constructor raised {describe_exception(exc)}"


def _describe(target: str) -> dict:
    """What the harness may know of a backend before running it: its declared data."""
    from conformance.backends.registry import UnknownBackendError
    from conformance.declared import describe_target

    try:
        return describe_target(target).as_data()
    except (UnknownBackendError, ValueError) as exc:
        raise ContractError(str(exc)) from None


def _answer(backend: Backend | None, message: tuple) -> tuple[list, Backend | None]:
    """The reply to one request, and the backend from then on (``open`` loads it)."""
    kind = message[0]
    opened = backend

    def work() -> Any:
        nonlocal opened
        if kind == "describe":
            return _describe(message[1])
        if kind == "open":
            opened, reason = _open(message[1])
            if opened is None:
                raise _UnavailableError(reason)
            return None
        _, name, args = message
        return CALLS[name](backend, *args)
    return _outcome(message[1] if kind == "call" else "loading the backend", work), opened


class _UnavailableError(Exception):
    """The backend cannot load here (its reason): not a fault of the case."""


def _outcome(what: str, work: Callable[[], Any]) -> list:
    """``work``'s reply: [kind, value, why the device is lost or None]. Whatever it raises,
    ``SystemExit`` and ``KeyboardInterrupt`` too, is the case's fault, described."""
    try:
        return ["ok", work(), None]
    except _UnavailableError as exc:
        return ["unavailable", str(exc), None]
    except ContractError as exc:
        return ["contract", str(exc), None]
    except BaseException as exc:
        text = f"{what} raised {describe_exception(exc)}"
        return ["raised", text, device_lost(text) or device_health()]


def serve(sock: socket.socket) -> None:
    """Answer the harness's requests until it sends None or goes away."""
    backend: Backend | None = None
    arena = Mapped()
    while True:
        frame = receive_frame_blocking(sock)
        if frame is None:
            return
        payload, fds = frame
        request = arena.unpack(payload, fds[0] if fds else None)
        if request is None:
            return
        number, message = request
        reply, backend = _answer(backend, message)
        del request, message  # the segment's views, freed early
        _flush_output()
        try:
            data = encode_reply([number, *reply])
        except Exception as exc:  # a result that is not plain data
            data = encode_reply([number, "raised", f"the result could not be sent back: "
                                                   f"{describe_exception(exc)}", None])
        send_frame(sock, data)


def _flush_output() -> None:
    """Everything the call printed, Python's buffers and C's, goes out before the reply."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _C_FFLUSH is not None:
        _C_FFLUSH(None)


def _c_fflush() -> Callable[[Any], int] | None:
    try:
        return ctypes.CDLL(None).fflush
    except (OSError, AttributeError):
        return None


_C_FFLUSH = _c_fflush()  # looked up once: a dlopen per call cost more than the flush


def run(channel: int) -> None:
    """Serve the harness on ``channel`` until it is done: a spawned worker's whole life, and
    a forked one's after the fork (``conformance.zygote``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when a worker ends
    faulthandler.enable()  # a native crash prints the Python stack into the captured output
    with profiled("worker"):
        serve(socket.socket(fileno=channel))


if __name__ == "__main__":
    run(int(sys.argv[1]))
