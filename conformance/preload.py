"""A backend's preload, stage by stage, kept as far as it leaves a process safe to fork from.

``Backend.preload`` imports what a worker needs, touching no device. Whether an import starts
the CUDA driver or a thread is not always the adapter's to know: on an H100 with torch
2.11 and Triton 3.6 the Triton preload left the driver's thread behind, and ``tvm_ffi`` asks
``torch.cuda.is_available()`` on import. So a preload written as a generator is divided by its
``yield``s, and each stage after the first runs in a fork of the process that ran the stages
before: the fork goes on as the zygote if the stage leaves it safe, else it ends and the
process before it serves. Workers are then forked from after the last safe stage rather than
spawned, and the run says which stage was given up and why (docs/isolation.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# torch's own switch: is_available() and device_count() ask NVML, not the CUDA driver, which
# a fork could not use after (a library's import may ask: tvm_ffi's does)
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


@dataclass
class Loaded:
    """What a zygote's preload came to: why it must not fork (None: it may), and why a
    later stage of the preload was not kept (None: every stage was)."""

    refused: str | None = None
    partial: str | None = None


def load_deepest(target: str) -> Loaded:
    """``target``'s preload, each stage after the first in a fork of the process before it.

    Returns in the process that serves: this one, or a fork of it that kept more stages;
    this one then waits for that fork and exits with it, never returning."""
    stages = _Stages(target)
    why = _run_stage(stages)
    if why:
        return Loaded(refused=why)
    done = 1
    while stages.more:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork tries the next stage
            os.close(read)
            end_with_parent()
            why = _run_stage(stages)
            os.write(write, b"kept" if why is None else why.encode() or b"?")
            os.close(write)
            if why is not None:
                os._exit(0)
            done += 1
            continue
        os.close(write)
        with os.fdopen(read, "rb") as verdict:
            why = verdict.read().decode()
        # kept: the fork serves from here on, and this process ends when it does
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if why == "kept":
            os._exit(max(0, status))
        why = why or f"it ended its process, exit status {status}"
        return Loaded(partial=f"stage {done + 1} of its preload was not kept ({why}); "
                              f"its workers are forked after stage {done}")
    return Loaded()


def unsafe() -> str | None:
    """Why this process must not fork a worker now, or None."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"loading the backend left {threads} threads in the zygote"
    if _cuda_initialised():
        return "loading the backend initialised CUDA in the zygote"
    return None


class _Stages:
    """The backend's preload one stage a call: a plain ``preload`` is one stage; a
    generator's ``yield``s end each but the last."""

    def __init__(self, target: str):
        self.target = target
        self.rest: Iterator[None] | None = None
        self.more = True

    def run_next(self) -> None:
        if self.rest is None:
            from conformance.backends.registry import resolve

            loaded = resolve(self.target).preload()
            if not inspect.isgenerator(loaded):
                self.more = False
                return
            self.rest = loaded
        try:
            next(self.rest)
        except StopIteration:
            self.more = False


def _run_stage(stages: _Stages) -> str | None:
    """The next stage, with torch counting GPUs through NVML; why this process must not fork
    after it, or None."""
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        stages.run_next()
    except BaseException as exc:  # the spawned worker meets it again, and reports it
        stages.more = False
        return f"loading the backend raised {type(exc).__name__}: {str(exc)[:200]}"
    finally:  # the workers start with the environment the zygote was given
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before
    return unsafe()


def end_with_parent() -> None:
    """PR_SET_PDEATHSIG, which a fork does not inherit: the zygote ends with the harness."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _cuda_initialised() -> bool:
    """Whether this process initialised the CUDA driver (a fork could not use it then)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    if "libcuda.so" not in maps:
        return False
    context = ctypes.c_void_p()
    # any driver call but a few answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit
    return ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(context)) != 3
