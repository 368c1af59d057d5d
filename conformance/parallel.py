"""Cases spread over worker processes; a worker that dies takes down one case, not the run.

Each worker is a spawned process (no CUDA state inherited) that opens the backends by name
and evaluates one (backend, case) at a time. The parent knows which case every worker holds,
so when a native crash kills a worker, that case is reported as ``error`` and a new worker
takes the next one.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from conformance.spec import Case

Task = tuple[str, Case]  # (backend target, case)


def gpu_count() -> int:
    """GPUs the driver sees, asked of NVML: CUDA reads CUDA_VISIBLE_DEVICES once, when it is
    initialised, so counting through CUDA (``torch.cuda.is_available()`` does) in a worker
    would pin that worker to every GPU before its own device is chosen."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    count = ctypes.c_uint(0)
    try:
        found = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    finally:
        nvml.nvmlShutdown()
    return count.value if found else 0


def gpu_environment(worker: int) -> dict[str, str]:
    """One GPU per worker, round-robin, when the machine has several (CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        devices = [str(i) for i in range(gpu_count())]
    else:
        devices = [d for d in visible.split(",") if d.strip()]
    if len(devices) < 2:
        return {}
    return {"CUDA_VISIBLE_DEVICES": devices[worker % len(devices)]}


def xdist_worker_environment() -> dict[str, str]:
    """The same spread for pytest-xdist's workers (gw0, gw1, ...)."""
    index = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    return gpu_environment(int(index)) if index.isdigit() else {}


def _worker(conn: Connection, settings, manifest_dir, env: dict[str, str]) -> None:
    os.environ.update(env)
    from conformance.runner import evaluate_case, open_backend

    backends = {}
    while True:
        task = conn.recv()
        if task is None:
            return
        index, (target, case) = task
        if target not in backends:
            backends[target] = open_backend(target, manifest_dir)
        conn.send((index, evaluate_case(backends[target], case, settings)))


def run_tasks(tasks: list[Task], settings, jobs: int,
              on_done: Callable[[int, list], None]) -> None:
    """Evaluate every task on ``jobs`` workers, calling ``on_done(index, results)``."""
    from conformance.runner import crashed_results

    context = multiprocessing.get_context("spawn")
    pending = list(enumerate(tasks))[::-1]
    workers: dict[Connection, tuple[multiprocessing.Process, int | None]] = {}

    def start(slot: int) -> None:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, daemon=True,
                                  args=(child, settings, settings.manifest_dir,
                                        gpu_environment(slot)))
        process.start()
        child.close()
        workers[parent] = (process, None)
        dispatch(parent)

    def dispatch(conn: Connection) -> None:
        process, _ = workers[conn]
        if pending:
            index, task = pending.pop()
            conn.send((index, task))
            workers[conn] = (process, index)
        else:
            conn.send(None)
            workers[conn] = (process, None)

    for slot in range(max(1, min(jobs, len(tasks)))):
        start(slot)
    while any(index is not None for _, index in workers.values()):
        sentinels = {process.sentinel: conn for conn, (process, _) in workers.items()}
        for ready in wait(list(workers) + list(sentinels)):
            conn = sentinels.get(ready, ready)
            if conn not in workers:
                continue
            process, index = workers[conn]
            if ready is conn:
                try:
                    done_index, results = conn.recv()
                except EOFError:
                    continue  # the sentinel reports the death
                on_done(done_index, results)
                dispatch(conn)
            elif not process.is_alive():
                del workers[conn]
                if index is not None:
                    target, case = tasks[index]
                    on_done(index, crashed_results(target, case, settings, process.exitcode))
                    start(len(workers))
    for process, _ in workers.values():
        process.join(timeout=10)
