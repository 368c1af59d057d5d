"""Backends that show how their worker was started, or spoil the zygote that forks them.

``tests/test_zygote.py`` runs them through the CLI: each writes what it sees of its own
process to ``$FORKED_MARK`` on every decode.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from conformance.backends.numpy_splitk import NumpySplitK


def seen() -> dict:
    """What a worker is, as a backend in it can tell."""
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return {"pid": os.getpid(), "parent": parent, "argv": sys.argv,
            "own_session": os.getsid(0) == os.getpid(),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
            "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "preloaded": "tests.forked" in sys.modules and PRELOADED,
            "stages": STAGES, "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}


PRELOADED = False
STAGES: list[int] = []  # the stages of a staged preload this process ran or inherited


class Reports(NumpySplitK):
    """Correct, and writes ``seen()`` on each decode."""

    name = "forked-reports"

    @classmethod
    def preload(cls) -> None:
        global PRELOADED
        PRELOADED = True

    def decode(self, problem, out, lse, *, num_splits=None):
        with open(os.environ["FORKED_MARK"], "a") as mark:
            mark.write(json.dumps(seen()) + "\n")
        super().decode(problem, out, lse, num_splits=num_splits)


class ThreadOnPreload(Reports):
    """Starts a thread while it preloads: forking from there is not safe."""

    name = "forked-thread-on-preload"

    @classmethod
    def preload(cls) -> None:
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()


class RaisesOnPreload(Reports):
    name = "forked-raises-on-preload"

    @classmethod
    def preload(cls) -> None:
        raise RuntimeError("no preloading here")


class SlowPreload(Reports):
    """Preloads for 3 s: a requester with less time than that spawns its worker."""

    name = "forked-slow-preload"

    @classmethod
    def preload(cls) -> None:
        time.sleep(3)


class Staged(Reports):
    """A preload of two stages, both safe: the workers are forked after both."""

    name = "forked-staged"
    second_stage = staticmethod(lambda: None)

    @classmethod
    def preload(cls) -> Iterator[None]:
        global PRELOADED
        PRELOADED = True
        STAGES.append(1)
        yield
        STAGES.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1" and 2)
        cls.second_stage()


class StagedThreadAfter(Staged):
    """Its second stage starts a thread: the workers are forked after the first."""

    name = "forked-staged-thread-after"
    second_stage = staticmethod(
        lambda: threading.Thread(target=time.sleep, args=(1000,), daemon=True).start())


class StagedCrashAfter(Staged):
    """Its second stage ends its process (a crash in an import): forked after the first."""

    name = "forked-staged-crash-after"
    second_stage = staticmethod(lambda: os.kill(os.getpid(), signal.SIGSEGV))
