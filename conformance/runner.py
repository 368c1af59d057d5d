"""Running check families for backends over cases, and turning outcomes into results.

Shared by the CLI and the pytest plugin: ``evaluate`` is one (backend, case, family), with
unsupported cases, faults and the expectation manifest already applied.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.base import Backend
from backends.registry import backend_label, resolve
from conformance.checks import CHECK_FAMILIES, Outcome, Trial, describe_exception
from conformance.manifest import Manifest, apply, glob_match, load_manifest
from conformance.spec import Case, Spec, SpecError, default_spec, load_spec

FAILING = ("failed", "error", "unexpected-pass")


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

    @property
    def family(self) -> str:
        return self.check.split("/", 1)[0]

    def as_dict(self) -> dict:
        return {**asdict(self), "family": self.family}


@dataclass
class BackendRun:
    """A backend as this run sees it: its label, class, instance (if available) and manifest."""

    label: str
    target: str
    cls: type[Backend]
    reason: str | None
    manifest: Manifest
    instance: Backend | None = None

    def describe(self) -> dict:
        return {"name": self.label, "target": self.target, "available": self.reason is None,
                "reason": self.reason or "", "description": self.cls.description,
                "capabilities": self.cls.capabilities.describe(),
                "conventions": self.cls.conventions.describe(),
                "expectations": str(self.manifest.path) if self.manifest.path else "",
                "notes": self.instance.notes() if self.instance else []}


def open_backend(name: str, manifest_dir: Path | None = None) -> BackendRun:
    cls = resolve(name)
    label = backend_label(name, cls)
    try:
        reason = cls.availability()
    except Exception as exc:
        reason = f"availability probe raised {describe_exception(exc)}"
    instance = None
    if reason is None:
        try:
            instance = cls()
        except Exception as exc:
            reason = f"constructor raised {describe_exception(exc)}"
    return BackendRun(label, name, cls, reason, load_manifest(label, manifest_dir), instance)


def pattern_matcher(pattern: str) -> Callable[[str], bool]:
    """Substring match; ``*`` and ``?`` are wildcards (brackets in ids are literal)."""
    return lambda text: glob_match(f"*{pattern}*", text)


def select_cases(spec: Spec, profile: str, patterns: Iterable[str] = (),
                 case_ids: Iterable[str] = ()) -> list[Case]:
    cases = spec.cases(profile)
    wanted = set(case_ids)
    if wanted:
        by_id = {c.id: c for spec_profile in spec.profiles for c in spec.cases(spec_profile)}
        missing = wanted - set(by_id)
        if missing:
            raise SpecError(f"unknown case id(s): {', '.join(sorted(missing))}")
        cases = [by_id[i] for i in by_id if i in wanted]
    matchers = [pattern_matcher(p) for p in patterns]
    return [c for c in cases if all(m(c.id) for m in matchers)]


@dataclass
class RunSettings:
    """What selects a run; also what a reproducer line must repeat."""

    profile: str = "ci"
    spec_path: str | None = None
    families: tuple[str, ...] = tuple(CHECK_FAMILIES)
    manifest_dir: Path | None = None
    filtered: bool = False  # cases or families were narrowed: stale entries mean nothing

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
    if backend.reason:
        return [Outcome(family, "unsupported", message=f"backend unavailable: {backend.reason}")]
    try:
        reason = backend.instance.unsupported_reason(case)
        if reason:
            return [Outcome(family, "unsupported", message=reason)]
        return CHECK_FAMILIES[family](trial or Trial(backend.instance, case))
    except Exception as exc:  # a fault in the adapter or the case is a result, not a crash
        return [Outcome(family, "error", message=describe_exception(exc))]


def evaluate(backend: BackendRun, case: Case, family: str, settings: RunSettings,
             trial: Trial | None = None) -> list[Result]:
    """The results of one check family for one case on one backend, manifest applied."""
    reproducer = settings.reproducer(backend.target, case.id, family)
    outcomes = family_outcomes(backend, case, family, trial)
    results = []
    statuses = apply(backend.manifest, case.id, [(o.check, o.status) for o in outcomes])
    for outcome, (status, note) in zip(outcomes, statuses, strict=True):
        message = "; ".join(part for part in (outcome.message, note) if part)
        budget = outcome.budget
        results.append(Result(
            backend=backend.label, case=case.id, check=outcome.check, status=status,
            error=outcome.error, budget=budget.value if budget else None,
            budget_table=budget.table if budget else None,
            budget_ratio=budget.ratio if budget else None, message=message,
            reproducer=reproducer))
    return results


@dataclass
class RunReport:
    settings: RunSettings
    backends: list[BackendRun]
    cases: list[Case]
    results: list[Result] = field(default_factory=list)
    strict_manifest: bool = False
    interrupted: str = ""  # why the run stopped early, if it did

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in FAILING]

    def stale_expectations(self) -> list[tuple[BackendRun, object]]:
        """Manifest entries that matched nothing (meaningful only in a whole run)."""
        if self.settings.filtered or self.interrupted:
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
        return not self.interrupted and not self.failures and not (
            self.strict_manifest and self.manifest_problems())


def evaluate_case(backend: BackendRun, case: Case, settings: RunSettings) -> list[Result]:
    """Every selected family of one case on one backend, sharing one trial."""
    trial = Trial(backend.instance, case) if backend.instance else None
    return [result for family in settings.families
            for result in evaluate(backend, case, family, settings, trial)]


def crashed_results(target: str, case: Case, settings: RunSettings,
                    exitcode: int | None) -> list[Result]:
    """What a case reports when its worker process died under it (a native crash)."""
    label = backend_label(target, resolve(target))
    how = f"signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
    return [Result(backend=label, case=case.id, check=family, status="error",
                   message=f"the worker process died ({how}) while running this case",
                   reproducer=settings.reproducer(target, case.id, family))
            for family in settings.families]


def run(backends: list[BackendRun], cases: list[Case], settings: RunSettings,
        progress: Callable[[int, int, str], None] | None = None, jobs: int = 1) -> RunReport:
    """Every family for every case on every backend; a backend fault never stops the run.

    With ``jobs > 1`` cases go to worker processes (``conformance.parallel``); results are
    reported in the same order as a serial run.
    """
    report = RunReport(settings, backends, cases)
    tasks = [(backend, case) for backend in backends for case in cases]
    collected: dict[int, list[Result]] = {}

    def done(index: int, results: list[Result]) -> None:
        collected[index] = results
        if progress:
            backend, case = tasks[index]
            progress(len(collected), len(tasks), f"{backend.label} {case.id}")

    try:
        if jobs > 1 and len(tasks) > 1:
            from conformance.parallel import run_tasks

            run_tasks([(b.target, c) for b, c in tasks], settings, jobs, done)
        else:
            for index, (backend, case) in enumerate(tasks):
                done(index, evaluate_case(backend, case, settings))
    except KeyboardInterrupt:  # Ctrl-C or a timeout's SIGTERM: keep what finished
        report.interrupted = f"interrupted after {len(collected)} of {len(tasks)} cases"
    report.results = [r for index in range(len(tasks)) if index in collected
                      for r in collected[index]]
    return report


def results_by_family(results: Iterable[Result]) -> Iterator[tuple[str, str, dict[str, int]]]:
    """(backend, family, {status: count}) in first-seen order."""
    table: dict[tuple[str, str], dict[str, int]] = {}
    for result in results:
        counts = table.setdefault((result.backend, result.family), {})
        counts[result.status] = counts.get(result.status, 0) + 1
    for (backend, family), counts in table.items():
        yield backend, family, counts
