"""Hostile backends: correct NumPy kernels that misbehave as untrusted code can.

Each one computes correctly on most cases and does one bad thing on the cases that have
attention sinks (``sinks > 0``), so a run shows both what the misbehaviour costs and that
it costs nothing else. ``tests/test_hostile.py`` runs them through the CLI.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from conformance.backends.base import AttentionState
from conformance.backends.numpy_splitk import NumpySplitK
from conformance.zygote import has_ended


def triggered(problem) -> bool:
    return problem.window is not None and problem.sinks > 0


class Misbehaves(NumpySplitK):
    """Runs ``misbehave`` before decoding the cases that have sinks."""

    name = "hostile-base"

    def decode(self, problem, out, lse, *, num_splits=None):
        if triggered(problem):
            self.misbehave(problem)
        super().decode(problem, out, lse, num_splits=num_splits)

    def misbehave(self, problem) -> None:
        raise NotImplementedError


class Segfaults(Misbehaves):
    name = "hostile-segfault"

    def misbehave(self, problem):
        os.kill(os.getpid(), signal.SIGSEGV)


class Aborts(Misbehaves):
    name = "hostile-abort"

    def misbehave(self, problem):
        os.abort()


class ExitsZero(Misbehaves):
    name = "hostile-exit-0"

    def misbehave(self, problem):
        sys.exit(0)


class ExitsThree(Misbehaves):
    name = "hostile-exit-3"

    def misbehave(self, problem):
        sys.exit(3)


class HardExit(Misbehaves):
    """``os._exit``: no exception, no cleanup, the process is simply gone."""

    name = "hostile-os-exit"

    def misbehave(self, problem):
        os._exit(0)


class RaisesKeyboardInterrupt(Misbehaves):
    name = "hostile-keyboard-interrupt"

    def misbehave(self, problem):
        raise KeyboardInterrupt


class HangsInPython(Misbehaves):
    name = "hostile-hang-python"

    def misbehave(self, problem):
        if os.environ.get("HOSTILE_MARK"):  # for a test that must know it hangs now
            open(os.environ["HOSTILE_MARK"], "w").close()
        while True:
            time.sleep(1)


class HangsInNativeCode(Misbehaves):
    """Blocks in C with every signal a harness might send to it blocked: only SIGKILL ends it."""

    name = "hostile-hang-native"

    def misbehave(self, problem):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        ctypes.CDLL(None).sleep(100000)


class MutatesBeforeComputing(Misbehaves):
    """Empties every context before computing: the output is then zero everywhere, and a
    harness that computed its oracle from the same arrays would agree."""

    name = "hostile-mutates-first"

    def misbehave(self, problem):
        problem.context_lens[...] = 0


class Floods(Misbehaves):
    """Prints 8 MB on stdout and stderr, from Python and from C."""

    name = "hostile-floods"

    def misbehave(self, problem):
        line = "flood " * 1000 + "\n"
        for _ in range(700):
            sys.stdout.write(line)
            sys.stderr.write(line)
        ctypes.CDLL(None).puts(b"\x1b[31mnative line with colour\x00")
        sys.stdout.write("LAST LINE OF THE FLOOD\n")


class EmptyAvailability(NumpySplitK):
    name = "hostile-empty-availability"

    @classmethod
    def availability(cls):
        return ""


class FalseAvailability(NumpySplitK):
    name = "hostile-false-availability"

    @classmethod
    def availability(cls):
        return False


class UnavailableInWorkers(NumpySplitK):
    """Available when the harness reads its declaration, gone when a worker opens it to run
    cases: a device that disappears after the probe. Told apart by the caller, not by order:
    the ``-j`` workers open the first backend while its probe runs, so either may ask first."""

    name = "hostile-unavailable-in-workers"

    @classmethod
    def availability(cls):
        return None if _called_from("conformance.declared", "of") else "no device in this process"


def _called_from(module: str, function: str) -> bool:
    """Whether ``module.function`` is on the calling stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == (module, function):
            return True
        frame = frame.f_back
    return False


class RaisesOnTrigger(Misbehaves):
    """A plain Python bug on the trigger cases: what a lost device must cost, and no more."""

    name = "hostile-raises"

    def misbehave(self, problem):
        raise RuntimeError("index out of range in the kernel's launch grid")


_DEVICE_LOST = False


class StickyDeviceFault(Misbehaves):
    """Like an out-of-bounds store on a GPU: the trigger case faults, and from then on every
    call in this process fails as CUDA does after an illegal memory access."""

    name = "hostile-sticky-device"

    def decode(self, problem, out, lse, *, num_splits=None):
        global _DEVICE_LOST
        if _DEVICE_LOST:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if triggered(problem):
            _DEVICE_LOST = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered\n"
                               "CUDA kernel errors might be asynchronously reported")
        super().decode(problem, out, lse, num_splits=num_splits)

    def merge(self, a, b):
        if _DEVICE_LOST:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().merge(a, b)


class ForksHelpers(Misbehaves):
    """Starts helper processes (a compiler daemon, a pool) that would outlive the run; their
    pids go to ``$HOSTILE_PIDS``."""

    name = "hostile-forks"

    def misbehave(self, problem):
        import subprocess

        helpers = [subprocess.Popen(["sleep", "1000"]) for _ in range(2)]
        pid = os.fork()
        if pid == 0:  # a forked child that keeps every descriptor of the worker
            time.sleep(1000)
            os._exit(0)
        with open(os.environ["HOSTILE_PIDS"], "a") as stream:
            stream.write("".join(f"{p}\n" for p in [pid, *(h.pid for h in helpers)]))


class SegfaultsWithForkedChild(Misbehaves):
    """Forks a child that holds the worker's socket and output pipe, then crashes: its death
    must be read from its exit status, not waited for at the end of a pipe."""

    name = "hostile-segfault-forked"

    def misbehave(self, problem):
        if os.fork() == 0:
            time.sleep(1000)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSEGV)


def _channel() -> int:
    return int(sys.argv[1])  # the worker's end of the channel to the harness


class StallsMidReply(Misbehaves):
    """Writes the start of a reply to the harness itself, then hangs."""

    name = "hostile-stalls-mid-reply"

    def misbehave(self, problem):
        os.write(_channel(), (1 << 20).to_bytes(8, "big") + b"{\"value\": ")
        time.sleep(1000)


class ForgesReply(Misbehaves):
    """Writes zeros, then sends the harness a reply of its own: a pickle that would mark a
    file and declare the call done if the harness unpickled it."""

    name = "hostile-forges-reply"

    def misbehave(self, problem):
        import pickle

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {os.environ['HOSTILE_MARK']}",))

        forged = pickle.dumps(("ok", (Payload(), None, ())))
        os.write(_channel(), len(forged).to_bytes(8, "big") + forged)

    def decode(self, problem, out, lse, *, num_splits=None):
        if triggered(problem):
            self.misbehave(problem)
            out[...] = 0
            lse[...] = 0
            return
        super().decode(problem, out, lse, num_splits=num_splits)


class ForgesPurity(NumpySplitK):
    """Scribbles on its inputs after computing, and tells the harness, in a well-formed data
    frame of its own, that the call is done: purity is what the harness sees, not what it is
    told."""

    name = "hostile-forges-purity"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        if triggered(problem):
            problem.k_pages[...] = 0
            from conformance.plain_replies import encode_reply

            for number in range(1, 200):  # guess the request's number
                frame = encode_reply([number, "ok", None, None])
                os.write(_channel(), len(frame).to_bytes(8, "big") + frame)


class UnnamedSubclass(NumpySplitK):
    """Sets no name: it would be reported as the real NumPy backend."""


class PathLikeName(NumpySplitK):
    name = "../.."


class MergeReturnsNone(NumpySplitK):
    name = "hostile-merge-none"

    def merge(self, a, b):
        return None


class MergeReturnsScalars(NumpySplitK):
    name = "hostile-merge-scalars"

    def merge(self, a, b):
        super().merge(a, b)
        return AttentionState(out=np.float32(0.0), lse=np.float32(0.0))


class MergeReturnsWrongDtypes(NumpySplitK):
    """The right values in float64 (output) and float16 (LSE)."""

    name = "hostile-merge-dtypes"

    def merge(self, a, b):
        merged = super().merge(a, b)
        return AttentionState(out=merged.out.astype(np.float64), lse=merged.lse.astype(np.float16))


def _both_empty(a, b) -> bool:
    return bool(np.isneginf(a.lse).all() and np.isneginf(b.lse).all())


class MergeRaisesOnEmpties(NumpySplitK):
    """Raises on merge(empty, empty) only: the sub-checks that ask it err, though the merge
    check sends its merges together."""

    name = "hostile-merge-raises"

    def merge(self, a, b):
        if _both_empty(a, b):
            raise RuntimeError("division by zero in the combine")
        return super().merge(a, b)


_MERGE_LOST_DEVICE = False


class MergeLosesDeviceOnEmpties(NumpySplitK):
    """merge(empty, empty) loses the device, and every later call in that process fails:
    the merges sent with it run again in a fresh worker."""

    name = "hostile-merge-lost"

    def merge(self, a, b):
        global _MERGE_LOST_DEVICE
        if _MERGE_LOST_DEVICE or _both_empty(a, b):
            _MERGE_LOST_DEVICE = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().merge(a, b)


_DECODE_LOST_DEVICE = False


class LosesDeviceOnThreeSplits(NumpySplitK):
    """A decode in three splits loses the device, and every later call in that process fails.
    The invariance check sends its next variant (eight splits) before this one's reply is
    back: it must be asked again of a fresh worker, and pass there."""

    name = "hostile-decode-lost"

    def decode(self, problem, out, lse, *, num_splits=None):
        global _DECODE_LOST_DEVICE
        if _DECODE_LOST_DEVICE or num_splits == 3:
            _DECODE_LOST_DEVICE = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().decode(problem, out, lse, num_splits=num_splits)


class MergeWritesEmptyInputs(NumpySplitK):
    """Writes into the inputs of merge(empty, empty); the merges sent with it (merge(x,
    empty) among them, whose empty state is the same array in the harness) keep theirs."""

    name = "hostile-merge-writes"

    def merge(self, a, b):
        merged = super().merge(a, b)
        if _both_empty(a, b):
            a.out[...], b.out[...] = 1, 1
        return merged


class NotesItsCacheDirs(NumpySplitK):
    """Says, in its notes, where its worker's compile caches are (``--cache-dir``)."""

    name = "notes-cache-dirs"

    def notes(self) -> list[str]:
        from conformance.caches import CACHE_VARIABLES

        return [f"{variable}={os.environ.get(variable, '')}" for variable in CACHE_VARIABLES]


class OutOfMemoryBesideOthers(Misbehaves):
    """Runs out of device memory on the trigger cases while another worker of it lives (as
    a GPU does when its neighbours hold the memory); alone, it computes them correctly.
    Each worker registers its pid in ``$HOSTILE_WORKERS``."""

    name = "hostile-oom-beside-others"

    def __init__(self):
        super().__init__()
        self.workers = Path(os.environ["HOSTILE_WORKERS"])
        (self.workers / str(os.getpid())).touch()

    def misbehave(self, problem):
        deadline = time.monotonic() + 10  # a -j 2 pool's other worker has started by then
        while len(list(self.workers.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        others = [int(p.name) for p in self.workers.iterdir() if int(p.name) != os.getpid()]
        for _ in range(10):  # another that lives on through 1 s shares the device with us
            if all(has_ended(pid) for pid in others):
                return
            time.sleep(0.1)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                           "total capacity of 79.19 GiB of which 1.12 GiB is free.")
