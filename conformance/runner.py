"""The engine of a run: every check family of every case on every backend, a backend fault
never stopping it.

Shared by the CLI, the pytest plugin and explore: ``evaluate`` is one (backend, case, family),
with unsupported cases, faults and the expectation manifest already applied; ``run`` is the
whole run, serial or over ``-j`` worker processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conformance.bulk import recycling
from conformance.checks import CHECK_FAMILIES, Trial
from conformance.checks.outcomes import unsupported
from conformance.manifest import apply
from conformance.result import Result
from conformance.sandbox import describe_exception
from conformance.session import BackendRun, RunSettings
from conformance.spec import Case
from conformance.status import FAILING, Status
from conformance.verdict import CaseRecord, RunReport

if TYPE_CHECKING:
    from conformance.parallel import Pool


def family_results(backend: BackendRun, case: Case, family: str,
                   trial: Trial | None = None) -> list[Result]:
    """Run one family, or say why it cannot run: unsupported, or an error with its cause."""
    if backend.reason:  # unavailable here: the harness refused it, so it is not claimed
        return [unsupported(family, f"backend unavailable: {backend.reason}")]
    try:
        reason = backend.handle.unsupported_reason(case)
        if reason:
            return [unsupported(family, reason)]
        return CHECK_FAMILIES[family](trial or Trial(backend.handle, case))
    except Exception as exc:  # a fault in the adapter or the case is a result, not a crash
        return [Result(family, Status.ERROR, message=describe_exception(exc))]


def evaluate(backend: BackendRun, case: Case, family: str, settings: RunSettings,
             trial: Trial | None = None) -> list[Result]:
    """The results of one check family for one case on one backend, manifest applied."""
    if backend.reason is None:
        backend.connect(settings.isolated)
    return placed(backend, case, family_results(backend, case, family, trial), settings)


def placed(backend: BackendRun, case: Case, results: list[Result],
           settings: RunSettings) -> list[Result]:
    """A check's results as reported: the expectation manifest applied, a reproducer each."""
    device = backend.device if any(e.device for e in backend.manifest.entries) else None
    statuses = apply(backend.manifest, case.id, [(r.check, r.status) for r in results], device)
    return [result.placed(backend.label, case.id, status, note,
                          settings.reproducer(backend.target, case.id, result.family),
                          case.dtype, max(case.context_lens))
            for result, (status, note) in zip(results, statuses, strict=True)]


def evaluate_case(backend: BackendRun, case: Case, settings: RunSettings) -> CaseRecord:
    """Every selected family of one case on one backend, sharing one trial and one clock."""
    if backend.reason is not None:
        return CaseRecord([r for family in settings.families
                           for r in evaluate(backend, case, family, settings)])
    started = time.monotonic()
    handle = backend.connect(settings.isolated)
    handle.begin_case(settings.case_timeout, case.id)
    trial = Trial(handle, case)
    with recycling():  # the case's pools share memory as they come and go
        results = [result for family in settings.families
                   for result in evaluate(backend, case, family, settings, trial)]
    return CaseRecord(results, handle.end_case(), handle.device(), handle.take_restarts(),
                      seconds=time.monotonic() - started)


def pool_size(jobs: int, tasks: int) -> int:
    """The ``-j`` processes ``tasks`` (backend, case) pairs get; 0: the run is serial."""
    return 0 if jobs < 2 or tasks < 2 else min(jobs, tasks)


def start_pool(jobs: int, tasks: int, target: str | None) -> Pool | None:
    """The ``-j`` worker processes for ``tasks`` (backend, case) pairs, started now, each
    opening ``target`` (the first backend's) ahead, so that they load it while the harness
    reads its declaration; None where the run is serial."""
    if not pool_size(jobs, tasks):
        return None
    from functools import partial

    from conformance.parallel import Pool
    from conformance.worker_process import open_ahead

    return Pool(_evaluate_in_worker, pool_size(jobs, tasks),
                partial(open_ahead, target) if target else None)


# Per worker process of ``-j``: the backends it has connected, by label.
_WORKER_BACKENDS: dict[str, BackendRun] = {}


def _evaluate_in_worker(task: tuple[BackendRun, Case, RunSettings]) -> CaseRecord:
    backend, case, settings = task
    for label, other in _WORKER_BACKENDS.items():
        if label != backend.label:  # one backend worker (one CUDA context) per process at a
            other.disconnect()      # time: 16 jobs x 7 GPU backends ran an H200 out of memory
    backend = _WORKER_BACKENDS.setdefault(backend.label, backend)
    return evaluate_case(backend, case, settings)


def crashed_record(backend: BackendRun, case: Case, settings: RunSettings,
                   exitcode: int | None) -> CaseRecord:
    """What a case reports when the harness worker died under it; manifests still apply."""
    how = f"signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
    died = [Result(family, Status.ERROR,
                   message=f"the worker process died ({how}) while running this case")
            for family in settings.families]
    return CaseRecord(placed(backend, case, died, settings))


# what CUDA, torch and the libraries say when the device's memory runs out
OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError|cudaErrorMemoryAllocation|"
                           r"CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
RAN_ALONE = ("it ran out of device memory beside other cases: run again alone, once every "
             "other worker had ended")


def out_of_memory(record: CaseRecord) -> bool:
    """Whether an error of this case was the device's memory running out: in a parallel
    run, possibly what its neighbours held rather than what it needs."""
    return any(r.status is Status.ERROR and OUT_OF_MEMORY.search(r.message or "")
               for r in record.results)


def run_alone(backend: BackendRun, case: Case, settings: RunSettings) -> CaseRecord:
    """A case again, in this process's own worker, with no other worker alive: its verdict
    must not depend on what other cases held on a shared device."""
    record = evaluate_case(backend, case, settings)
    record.restarts.insert(0, RAN_ALONE)
    return record


def run(backends: list[BackendRun], cases: list[Case], settings: RunSettings,
        progress: Callable[[int, int, str, int], None] | None = None,
        jobs: int = 1, pool: Pool | None = None) -> RunReport:
    """Every family for every case on every backend; a backend fault never stops the run.

    With ``jobs > 1`` cases go to worker processes (``conformance.parallel``; ``pool``: ones
    started already, by ``start_pool``), each backend's largest (``Case.problem_bytes``) first;
    a case that ran out of device memory there runs again alone after them (``run_alone``);
    results are reported in the same order as a serial run. ``progress(done, total, label,
    failing)`` hears of each finished case, with the unexpected failures so far.
    """
    report = RunReport(settings, backends, cases)
    tasks = [(backend, case) for backend in backends for case in cases]
    collected: dict[int, CaseRecord] = {}
    failing = 0

    def done(index: int, record: CaseRecord) -> None:
        nonlocal failing
        collected[index] = record
        failing += sum(r.status in FAILING for r in record.results)
        if progress:
            backend, case = tasks[index]
            progress(len(collected), len(tasks), f"{backend.label} {case.id}", failing)

    def crashed(index: int, exitcode: int | None) -> CaseRecord:
        backend, case = tasks[index]
        return crashed_record(backend, case, settings, exitcode)

    try:
        if pool is not None or (jobs > 1 and len(tasks) > 1):
            from conformance.parallel import longest_first, run_pool

            detached = {b.label: b.detached() for b in backends}
            run_pool([(detached[b.label], c, settings) for b, c in tasks], _evaluate_in_worker,
                     jobs, done, crashed, pool,
                     longest_first([case.problem_bytes for _, case in tasks],
                                   [b for b in range(len(backends)) for _ in cases]))
            again = sorted(i for i, record in collected.items() if out_of_memory(record))
            if again and pool is not None:
                pool.close()  # its workers, and what they hold on the device, end first
            for index in again:
                for other in backends:  # one worker alive: the one the case runs in
                    if other is not tasks[index][0]:
                        other.disconnect()
                collected[index] = run_alone(*tasks[index], settings)
        else:
            for index, (backend, case) in enumerate(tasks):
                done(index, evaluate_case(backend, case, settings))
    except KeyboardInterrupt:  # Ctrl-C or a timeout's SIGTERM: keep what finished
        report.interrupted = f"interrupted after {len(collected)} of {len(tasks)} cases"
    finally:
        for backend in backends:
            backend.disconnect()
    for index in range(len(tasks)):
        if index in collected:
            record = collected[index]
            report.results.extend(record.results)
            backend, case = tasks[index]
            if record.captured is not None:
                report.captured[(backend.label, case.id)] = record.captured
            if record.restarts:
                report.restarts[(backend.label, case.id)] = record.restarts
            if record.device:
                report.devices[backend.label] = record.device
            if record.seconds:
                report.durations[(backend.label, case.id)] = record.seconds
    return report

