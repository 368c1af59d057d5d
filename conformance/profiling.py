"""Where a run's time goes, in every process of it: ``CONFORMANCE_PROFILE=DIR``.

A run is three kinds of process: the harness (``conformance``), the ``-j`` pool's processes
(each the harness of its cases) and the backend workers. A profile of the first alone shows
the others as time spent waiting, so with the variable set each writes its own cProfile
statistics, ``DIR/<role>-<pid>.prof``, when it ends normally; ``python
benchmarks/profile_report.py DIR`` adds them up per role. Standard library only: the pool
and the worker read it before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PROFILE_VARIABLE = "CONFORMANCE_PROFILE"
ROLES = ("harness", "pool", "worker")


@contextlib.contextmanager
def profiled(role: str) -> Iterator[None]:
    """Profile the body into ``$CONFORMANCE_PROFILE/<role>-<pid>.prof`` when the variable is
    set; otherwise do nothing."""
    folder = os.environ.get(PROFILE_VARIABLE)
    if not folder:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        Path(folder).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(str(Path(folder) / f"{role}-{os.getpid()}.prof"))
