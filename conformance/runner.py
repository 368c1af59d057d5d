"""Running check families for backends over cases, and turning outcomes into results.

Shared by the CLI and the pytest plugin: ``evaluate`` is one (backend, case, family), with
unsupported cases, faults and the expectation manifest already applied.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from conformance.backends.base import Backend, Capabilities
from conformance.checks import CHECK_FAMILIES, Outcome, Trial
from conformance.declared import Declared, describe_target
from conformance.manifest import Manifest, apply, load_manifest
from conformance.sandbox import (
    BackendHandle,
    Captured,
    InProcessBackend,
    IsolatedBackend,
    describe_exception,
)
from conformance.spec import Case, Spec, SpecError, default_spec, load_spec
from conformance.status import FAILING, Status
from conformance.worker_process import Probe

DEFAULT_CASE_TIMEOUT = 300.0  # seconds; 0 disables
MAX_SECONDS = 1_000_000  # the longest timeout taken (11.6 days): past it no wait is meant


@dataclass(frozen=True)
class Result:
    """One sub-check of one case on one backend, as reported."""

    backend: str
    case: str
    check: str
    status: str
    error: float | None = None
    budget: float | None = None
    budget_table: float | None = None
    budget_ratio: float | None = None
    message: str = ""
    reproducer: str = ""
    dtype: str = ""  # the case's, so that reports never parse ids
    context: int = 0  # the case's longest context

    @property
    def family(self) -> str:
        return self.check.split("/", 1)[0]

    def as_dict(self) -> dict:
        return {**asdict(self), "family": self.family}


@dataclass
class BackendRun:
    """A backend as this run sees it: its label, what it declares (data read off its class in a
    worker), its manifest, and the handle through which the run reaches it (made on first use)."""

    label: str
    target: str
    declared: Declared
    manifest: Manifest
    handle: BackendHandle | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        """Why the backend cannot run here, or None."""
        return self.declared.availability

    @property
    def capabilities(self) -> Capabilities:
        return self.declared.capabilities

    @property
    def device(self) -> str | None:
        """Where the backend runs, for manifest entries that name a device."""
        return self.handle.device() if self.handle is not None else None

    def connect(self, isolated: bool = True) -> BackendHandle:
        if self.handle is None:
            self.handle = (IsolatedBackend(self.declared, self.target) if isolated
                           else InProcessBackend(self.declared, self.target))
        return self.handle

    def disconnect(self) -> None:
        if self.handle is not None:
            self.notes = self.handle.notes()
            self.handle.close()
            self.handle = None

    def detached(self) -> BackendRun:
        """This backend without its handle, to hand to another process (``-j``)."""
        return replace(self, handle=None, notes=[])

    def instance(self) -> Backend:
        """The backend constructed in this process, for timing (bench); never for checks."""
        return self.connect(isolated=False).instance

    def describe(self) -> dict:
        return {"name": self.label, "target": self.target, "available": self.reason is None,
                "reason": self.reason or "", "description": self.declared.description,
                "capabilities": self.capabilities.describe(),
                "conventions": self.declared.conventions.describe(),
                "expectations": str(self.manifest.path) if self.manifest.path else "",
                "notes": self.notes, "declared": self.declared.as_data()}

    @classmethod
    def recorded(cls, described: dict, manifest_dir: Path | None) -> BackendRun:
        """A backend as a report recorded it: what ``merge`` judges shards by, with neither
        the backend's code nor its libraries here (GPU shards merged on a CPU machine)."""
        declared = Declared.from_data(described["declared"], described["target"])
        return cls(declared.name, described["target"], declared,
                   load_manifest(declared.name, manifest_dir))


def open_backend(name: str, manifest_dir: Path | None = None, isolated: bool = True,
                 load_timeout: float | None = DEFAULT_CASE_TIMEOUT) -> BackendRun:
    """Read a backend's declaration: in a worker (its import and availability check under the
    same isolation and timeout as its calls), or here with ``isolated=False``."""
    return open_backends([name], manifest_dir, isolated, load_timeout)[0]


def open_backends(names: Iterable[str], manifest_dir: Path | None = None,
                  isolated: bool = True,
                  load_timeout: float | None = DEFAULT_CASE_TIMEOUT) -> list[BackendRun]:
    """Open several backends, loading side by side; two that would be reported under one name
    are refused."""
    names = list(names)
    if isolated:
        probes = [Probe(name, load_timeout) for name in names]
        declared = []
        try:
            for loading in probes:
                declared.append(loading.result())
        finally:
            for loading in probes[len(declared) + 1:]:
                loading.worker.end()
    else:
        declared = [describe_target(name) for name in names]
    opened = [BackendRun(d.name, name, d, load_manifest(d.name, manifest_dir))
              for name, d in zip(names, declared, strict=True)]
    seen: dict[str, str] = {}
    for backend in opened:
        if backend.label in seen:
            raise SpecError(f"backends {seen[backend.label]!r} and {backend.target!r} are both "
                            f"named {backend.label!r}; a name must be unique in a run")
        seen[backend.label] = backend.target
    return opened


@dataclass
class RunSettings:
    """What selects a run; also what a reproducer line must repeat."""

    profile: str = "ci"
    spec_path: str | None = None
    families: tuple[str, ...] = tuple(CHECK_FAMILIES)
    manifest_dir: Path | None = None
    filtered: bool = False  # cases or families were narrowed: stale entries mean nothing
    isolated: bool = True  # backends in worker processes; False only to debug in-process
    case_timeout: float = DEFAULT_CASE_TIMEOUT  # seconds per (backend, case); 0: none
    allow_empty: bool = False  # a backend claiming no case of the run is not a failure
    shard: tuple[int, int] | None = None  # (K, N): this run is share K of N (conformance.shards)

    def spec(self) -> Spec:
        return load_spec(self.spec_path) if self.spec_path else default_spec()

    def reproducer(self, backend: str, case: str, family: str) -> str:
        words = ["python", "-m", "conformance", "run", "--backend", backend, "--profile",
                 self.profile, "--case", case, "--check", family]
        if self.spec_path:
            words += ["--spec", self.spec_path]
        return shlex.join(words)


def check_families(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(names)
    unknown = [n for n in names if n not in CHECK_FAMILIES]
    if unknown:
        raise ValueError(f"unknown check family {unknown[0]!r}; known: {', '.join(CHECK_FAMILIES)}")
    return names


def family_outcomes(backend: BackendRun, case: Case, family: str,
                    trial: Trial | None = None) -> list[Outcome]:
    """Run one family, or say why it cannot run: unsupported, or an error with its cause."""
    if backend.reason:  # unavailable here: the harness refused it, so it is not claimed
        return [Outcome(family, Status.UNSUPPORTED,
                        message=f"backend unavailable: {backend.reason}")]
    try:
        reason = backend.handle.unsupported_reason(case)
        if reason:
            return [Outcome(family, Status.UNSUPPORTED, message=reason)]
        return CHECK_FAMILIES[family](trial or Trial(backend.handle, case))
    except Exception as exc:  # a fault in the adapter or the case is a result, not a crash
        return [Outcome(family, Status.ERROR, message=describe_exception(exc))]


def evaluate(backend: BackendRun, case: Case, family: str, settings: RunSettings,
             trial: Trial | None = None) -> list[Result]:
    """The results of one check family for one case on one backend, manifest applied."""
    if backend.reason is None:
        backend.connect(settings.isolated)
    return results_of(backend, case, family_outcomes(backend, case, family, trial), settings)


def results_of(backend: BackendRun, case: Case, outcomes: list[Outcome],
               settings: RunSettings) -> list[Result]:
    """Outcomes as reported results: the expectation manifest applied, a reproducer each."""
    results = []
    device = backend.device if any(e.device for e in backend.manifest.entries) else None
    statuses = apply(backend.manifest, case.id, [(o.check, o.status) for o in outcomes],
                     device)
    for outcome, (status, note) in zip(outcomes, statuses, strict=True):
        message = "; ".join(part for part in (outcome.message, note) if part)
        budget = outcome.budget
        results.append(Result(
            backend=backend.label, case=case.id, check=outcome.check, status=status,
            error=outcome.error, budget=budget.value if budget else None,
            budget_table=budget.table if budget else None,
            budget_ratio=budget.ratio if budget else None, message=message,
            reproducer=settings.reproducer(backend.target, case.id, outcome.family),
            dtype=case.dtype, context=max(case.context_lens)))
    return results


@dataclass
class CaseRecord:
    """What one (backend, case) produced: its results and what the backend printed."""

    results: list[Result]
    captured: Captured | None = None
    device: str | None = None  # where the backend ran ("cpu", "cuda"), when it could say
    restarts: list[str] = field(default_factory=list)  # why its worker was replaced
    seconds: float = 0.0  # wall-clock time of the case's checks on this backend


@dataclass
class RunReport:
    settings: RunSettings
    backends: list[BackendRun]
    cases: list[Case]
    results: list[Result] = field(default_factory=list)
    strict_manifest: bool = False
    interrupted: str = ""  # why the run stopped early, if it did
    captured: dict[tuple[str, str], Captured] = field(default_factory=dict)
    restarts: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (backend, case)
    devices: dict[str, str] = field(default_factory=dict)  # backend label -> where it ran
    durations: dict[tuple[str, str], float] = field(default_factory=dict)  # (backend, case)
    # what the machine that ran the cases recorded (a merge of shards keeps the shards'
    # machine and backend descriptions, not those of the machine that merges them)
    recorded_machine: dict | None = None
    recorded_backends: dict[str, dict] = field(default_factory=dict)  # label -> description

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in FAILING]

    def slowest(self, count: int) -> list[tuple[str, str, float]]:
        """The ``count`` slowest (backend, case, seconds), slowest first: what a profile
        costs, and which case is a run's critical path."""
        ranked = sorted(self.durations.items(), key=lambda item: -item[1])[:count]
        return [(backend, case, seconds) for (backend, case), seconds in ranked]

    def unclaimed(self) -> list[str]:
        """Why each backend that claims no check of this run fails it (unless allowed)."""
        if self.settings.allow_empty or self.settings.shard or self.interrupted:
            return []  # a shard may hold none of a backend's cases; the merged report judges
        problems = []
        for backend in self.backends:
            statuses = {r.status for r in self.results if r.backend == backend.label}
            if statuses <= {Status.UNSUPPORTED}:
                problems.append(
                    f"backend {backend.label} claims no check of this run (profile "
                    f"{self.settings.profile}, {len(self.cases)} cases): it claims "
                    f"{backend.capabilities.summary()}; pass --allow-empty if that is meant")
        return problems

    def stale_expectations(self) -> list[tuple[BackendRun, object]]:
        """Manifest entries that matched nothing (meaningful only in a whole run)."""
        if self.settings.filtered or self.settings.shard or self.interrupted:
            return []
        return [(b, e) for b in self.backends for e in b.manifest.stale(
            [(r.case, r.check) for r in self.results if r.backend == b.label])]

    def manifest_problems(self) -> list[str]:
        """What --strict-manifest fails on: stale entries and unfilled placeholder reasons."""
        problems = [f"{b.manifest.path}:{e.line}: entry matches nothing (case {e.case!r}, "
                    f"check {e.check!r})" for b, e in self.stale_expectations()]
        problems += [f"{b.manifest.path}:{e.line}: placeholder reason; say why it fails"
                     for b in self.backends for e in b.manifest.placeholders()]
        return problems

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.failures and not self.unclaimed() and not (
            self.strict_manifest and self.manifest_problems())


def evaluate_case(backend: BackendRun, case: Case, settings: RunSettings) -> CaseRecord:
    """Every selected family of one case on one backend, sharing one trial and one clock."""
    if backend.reason is not None:
        return CaseRecord([r for family in settings.families
                           for r in evaluate(backend, case, family, settings)])
    started = time.monotonic()
    handle = backend.connect(settings.isolated)
    handle.begin_case(settings.case_timeout, case.id)
    trial = Trial(handle, case)
    results = [result for family in settings.families
               for result in evaluate(backend, case, family, settings, trial)]
    return CaseRecord(results, handle.end_case(), handle.device(), handle.take_restarts(),
                      seconds=time.monotonic() - started)


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
    outcomes = [Outcome(family, Status.ERROR, message=f"the worker process died ({how}) while "
                                                 f"running this case")
                for family in settings.families]
    return CaseRecord(results_of(backend, case, outcomes, settings))


def run(backends: list[BackendRun], cases: list[Case], settings: RunSettings,
        progress: Callable[[int, int, str, int], None] | None = None,
        jobs: int = 1) -> RunReport:
    """Every family for every case on every backend; a backend fault never stops the run.

    With ``jobs > 1`` cases go to worker processes (``conformance.parallel``); results are
    reported in the same order as a serial run. ``progress(done, total, label, failing)``
    hears of each finished case, with the unexpected failures so far.
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
        if jobs > 1 and len(tasks) > 1:
            from conformance.parallel import run_pool

            detached = {b.label: b.detached() for b in backends}
            run_pool([(detached[b.label], c, settings) for b, c in tasks], _evaluate_in_worker,
                     jobs, done, crashed)
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

