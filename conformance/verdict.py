"""A run's verdict: what each (backend, case) produced, and whether the whole run passes
(no unexpected failure, every backend claiming something, a manifest without stale entries
when asked)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.result import Result
from conformance.sandbox import Captured
from conformance.session import BackendRun, RunSettings
from conformance.spec import Case
from conformance.status import FAILING, Status


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


