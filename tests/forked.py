"""Backends that show how their worker was started, or spoil the zygote that forks them.

``tests/test_zygote.py`` runs them through the CLI: each writes what it sees of its own
process to ``$FORKED_MARK`` on every decode.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
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
            "preloaded": "tests.forked" in sys.modules and PRELOADED}


PRELOADED = False


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
