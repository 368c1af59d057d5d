"""How a side of the harness-worker channel waits for the other: it polls while a CPU is
spare, then sleeps. Standard library only (the pool of ``-j`` reads it too)."""

from __future__ import annotations

import os
import select
import socket
import time

POLL_VARIABLE = "CONFORMANCE_POLL_SECONDS"  # the environment's say (0: never poll)
POLL_SECONDS = 0.005  # how long a side that waits for the other polls before it sleeps
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def poll_seconds() -> float:
    try:
        return float(os.environ.get(POLL_VARIABLE, POLL_SECONDS))
    except ValueError:
        return POLL_SECONDS


def poll_readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` became readable while polling it for up to ``seconds``, which only
    happens while the machine runs no more tasks than this process has CPUs (else at once
    False: the caller sleeps in ``select``). Harness and worker take turns, a call at a
    time; a side that sleeps is woken by the other's frame, and on a virtual machine that
    wake-up cost 0.2-0.3 ms a call, a fifth of the NumPy ``ci`` run (docs/isolation.md)."""
    if seconds <= 0 or not spare_cpu():
        return False
    end = time.monotonic() + seconds
    while True:
        if readable(sock):
            return True
        if time.monotonic() >= end:
            return False
        os.sched_yield()


def spare_cpu() -> bool:
    """Whether the machine runs no more tasks than this process may use CPUs."""
    running = runnable_tasks()
    return running is not None and running <= CPUS


def runnable_tasks() -> int | None:
    """The tasks the machine runs or could run now, this one included (Linux's
    ``/proc/loadavg``); None where it cannot say."""
    try:
        with open("/proc/loadavg", "rb") as stream:
            return int(stream.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])
