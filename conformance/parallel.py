"""A crash-isolating pool of spawned workers, and the GPU each worker gets.

The pool knows nothing of cases or reports: it hands items to workers (spawned, so no CUDA
state is inherited), collects results, and when a worker dies asks the caller's crash policy
for the item's result. The runner uses it for ``-j``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from conformance.blas_threads import one_blas_thread
from conformance.polling import CPUS, POLL_VARIABLE
from conformance.profiling import profiled


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


def gpu_count_apart() -> int:
    """``gpu_count`` asked in a forked child, for a process that forks workers later (a
    zygote): NVML leaves a thread of its own behind in the process that asks (an H100,
    2026-12-07), and a process with a second thread must not fork."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, str(gpu_count()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        told = answer.read()
    os.waitpid(pid, 0)
    return int(told) if told.isdigit() else 0


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
    """The same for pytest-xdist's workers (gw0, gw1, ...): the GPU spread, and polling."""
    index = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not index.isdigit():
        return {}
    return {**gpu_environment(int(index)),
            **(polling_environment(int(count)) if count.isdigit() else {}),
            **(thread_environment(int(count)) if count.isdigit() else {})}


def polling_environment(jobs: int) -> dict[str, str]:
    """Sleep, not poll, when a job's harness and worker cannot each have a CPU: polling
    then takes the CPU the other side needs (-j 2 on two cores: 2-7% slower)."""
    return {POLL_VARIABLE: "0"} if 2 * jobs > CPUS else {}


# the thread pools of the backend's libraries: OpenMP (torch's CPU ops), TVM's runtime
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TVM_NUM_THREADS")


def thread_environment(jobs: int) -> dict[str, str]:
    """A job's share of the cores for each library's thread pool, and NumPy's BLAS on one
    thread (``conformance.blas_threads``), where the user set none.

    Each library sizes its pool to the whole machine, in every process: 16 jobs on 16 cores
    ran 32 processes of 16 OpenBLAS and OpenMP threads each, and the `full` served-model
    cases of Qwen took 21 s at -j 16 on an H100 machine against 7.5 s with one thread a
    process (docs/isolation.md)."""
    share = str(max(1, CPUS // max(1, jobs)))
    return {**{name: share for name in THREAD_VARIABLES if name not in os.environ},
            **one_blas_thread()}


def pool_environment(jobs: int) -> dict[str, str]:
    """What each of ``jobs`` workers' environment adds, but for its GPU."""
    return {**polling_environment(jobs), **thread_environment(jobs)}


@contextlib.contextmanager
def spawned_with(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while a process is spawned, then as it was:
    a library reads its variables when it loads, which in a spawned worker is while its
    arguments are unpickled, before any code of ours runs there."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _serve(conn: Connection, work: Callable[[Any], Any],
           warm: Callable[[], Callable[[], None]] | None) -> None:
    with profiled("pool"):
        cool = warm() if warm is not None else None
        try:
            while (task := conn.recv()) is not None:
                index, item = task
                conn.send((index, work(item)))
        finally:
            if cool is not None:
                cool()


class Pool:
    """``jobs`` spawned workers, started before their items are known.

    Each first calls ``warm()`` (a module-level callable, pickled by name), which may begin
    something slow (opening a backend) while the caller still prepares the items, and returns
    what ends it if it went unused. ``run`` then calls ``work(item)`` for every item: each
    result goes to ``on_done(index, result)``; when a worker dies holding an item,
    ``on_crash(index, exitcode)`` makes its result instead and a new worker (not warmed)
    takes the dead one's slot (and GPU). Items go out in ``order`` (indices), by default
    as given; the indices ``on_done`` hears are always the items' own.
    """

    def __init__(self, work: Callable[[Any], Any], jobs: int,
                 warm: Callable[[], Callable[[], None]] | None = None):
        self.context = multiprocessing.get_context("spawn")
        self.work, self.jobs = work, max(1, jobs)
        # connection -> (process, slot, index of the item it holds or None)
        self.workers: dict[Connection, tuple[multiprocessing.Process, int, int | None]] = {}
        for slot in range(self.jobs):
            self._start(slot, warm)

    def _start(self, slot: int, warm: Callable[[], Callable[[], None]] | None = None
               ) -> Connection:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=_serve, daemon=True,
                                       args=(child, self.work, warm))
        with spawned_with({**gpu_environment(slot), **pool_environment(self.jobs)}):
            process.start()
        child.close()
        self.workers[parent] = (process, slot, None)
        return parent

    def run(self, items: list[Any], on_done: Callable[[int, Any], None],
            on_crash: Callable[[int, int | None], Any], order: Sequence[int] | None = None
            ) -> None:
        pending = [(i, items[i]) for i in (range(len(items)) if order is None else order)]
        pending.reverse()
        workers = self.workers

        def dispatch(conn: Connection) -> None:
            process, slot, _ = workers[conn]
            task = pending.pop() if pending else None
            conn.send(task)
            workers[conn] = (process, slot, task[0] if task else None)

        for conn in list(workers):
            dispatch(conn)
        while any(index is not None for _, _, index in workers.values()):
            sentinels = {process.sentinel: conn for conn, (process, _, _) in workers.items()}
            for ready in wait(list(workers) + list(sentinels)):
                conn = sentinels.get(ready, ready)
                if conn not in workers:
                    continue
                process, slot, index = workers[conn]
                if ready is conn:
                    try:
                        done_index, result = conn.recv()
                    except (EOFError, OSError):  # a reset connection too
                        continue  # the sentinel reports the death
                    on_done(done_index, result)
                    dispatch(conn)
                elif not process.is_alive():
                    del workers[conn]
                    if index is not None:
                        on_done(index, on_crash(index, process.exitcode))
                        dispatch(self._start(slot))

    def close(self) -> None:
        """End every worker: told to (again, for one that ran out of items: harmless), then
        given 5 s, then killed."""
        for conn in self.workers:
            try:
                conn.send(None)
            except OSError:  # it has ended
                pass
        for process, _, _ in self.workers.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        self.workers = {}


def longest_first(costs: Sequence[float], groups: Sequence[int] | None = None) -> list[int]:
    """Indices of ``costs``, largest first within each group; groups, and equal costs, in
    their own order.

    A parallel run ends with its longest item: started last (as the `full` profile's long
    model shapes were, 160 s cases begun at 240 s of a 260 s share), it alone sets the wall
    time; started first, it runs beside the rest (the LPT rule of list scheduling). Groups
    (a run's backends) stay apart: a worker that changes backend closes the one it held."""
    return sorted(range(len(costs)), key=lambda i: (groups[i] if groups else 0, -costs[i]))


def run_pool(items: list[Any], work: Callable[[Any], Any], jobs: int,
             on_done: Callable[[int, Any], None],
             on_crash: Callable[[int, int | None], Any], pool: Pool | None = None,
             order: Sequence[int] | None = None) -> None:
    """``Pool.run`` on ``pool``, or on a pool of ``jobs`` workers started here. ``work`` must
    be a module-level function (it is pickled by name)."""
    own = pool is None
    pool = pool or Pool(work, min(jobs, len(items)))
    try:
        pool.run(items, on_done, on_crash, order)
    finally:
        if own:
            pool.close()
