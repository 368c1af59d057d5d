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

import numpy as np

from backends.base import AttentionState
from backends.numpy_splitk import NumpySplitK


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


def in_backend_worker() -> bool:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return getattr(spec, "name", "") == "conformance.worker"


class UnavailableInWorkers(NumpySplitK):
    """Available where the harness probes it, unavailable in the process that runs it."""

    name = "hostile-unavailable-in-workers"

    @classmethod
    def availability(cls):
        return "no device in this process" if in_backend_worker() else None


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
