"""What a run is before it runs: the backends it opened (each as a ``BackendRun``: its
declaration, manifest and the handle that reaches it) and the settings that select it."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from conformance.backends.base import Backend, Capabilities
from conformance.checks import CHECK_FAMILIES
from conformance.declared import Declared, describe_target
from conformance.manifest import Manifest, load_manifest
from conformance.sandbox import BackendHandle, InProcessBackend, IsolatedBackend
from conformance.spec import Spec, SpecError, default_spec, load_spec
from conformance.worker_process import Probe

DEFAULT_CASE_TIMEOUT = 300.0  # seconds; 0 disables
MAX_SECONDS = 1_000_000  # the longest timeout taken (11.6 days): past it no wait is meant


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


