"""The pytest face of the suite: ``pytest --conformance-backend NAME --conformance-profile ci``.

Each (backend, case, check family) is one test whose id is ``backend/case-id/family``.
Unsupported cases are skipped with the capability as reason, manifest-listed failures are
xfailed with the manifest's reason, everything else passes or fails with the measured error
and a reproducer. With ``--conformance-backend`` given, only conformance tests are collected.
The plugin loads in every pytest run of the environment it is installed in, so its options
carry a prefix (a project's own ``--backend`` stays its own) and it does nothing until asked
by option or until its tests are collected.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance.backends.registry import UnknownBackendError
from conformance.checks import CHECK_FAMILIES, Trial
from conformance.manifest import ManifestError
from conformance.parallel import xdist_worker_environment
from conformance.runner import evaluate
from conformance.selection import select_cases
from conformance.session import (
    DEFAULT_CASE_TIMEOUT,
    MAX_SECONDS,
    BackendRun,
    RunSettings,
    check_families,
    open_backend,
)
from conformance.spec import Case, SpecError
from conformance.status import FAILING, Status

DEFAULT_BACKEND = "numpy"
DEFAULT_PROFILE = "smoke"


PREFIX = "conformance"  # every option is --conformance-*, as pytest-benchmark's are --benchmark-*


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "paged decode attention conformance")

    def option(name: str, **kwargs) -> None:
        group.addoption(f"--{PREFIX}-{name}", dest=f"{PREFIX}_{name.replace('-', '_')}",
                        **kwargs)

    option("backend", action="append", default=[], metavar="NAME",
           help="backend to check (registered name or module:Class; repeatable). Giving it "
                f"runs only the conformance tests. Default: {DEFAULT_BACKEND}.")
    option("profile", default=DEFAULT_PROFILE, help=f"spec profile (default: {DEFAULT_PROFILE})")
    option("spec", default=None, help="a spec TOML other than the built-in one")
    option("check", action="append", default=[], metavar="FAMILY",
           help=f"check family to run, repeatable (default all: {', '.join(CHECK_FAMILIES)})")
    option("expectations", default=None, type=Path,
           help="directory of expectation manifests (default: expectations/)")
    option("case-timeout", default=DEFAULT_CASE_TIMEOUT, type=float, metavar="SECONDS",
           help="kill a backend that spends longer on one test (a case's check family) and "
                f"fail it (default {DEFAULT_CASE_TIMEOUT:g}; 0: never)")
    option("explore", type=int, default=0, metavar="N",
           help="instead of the spec's cases, let explore draw N cases per backend "
                "(Hypothesis) and fail with each shrunk failure as a spec entry")
    option("explore-seed", type=int, default=0, help="explore's seed (default 0)")
    option("in-process", action="store_true",
           help="call the backend in the pytest process (to debug it): no isolation")
    option("allow-empty", action="store_true",
           help="skip, not fail, the tests of a backend that is unavailable or claims none of "
                "the selected cases")


def _option(config: pytest.Config, name: str):
    return config.getoption(f"{PREFIX}_{name}")


def _asked(config: pytest.Config) -> bool:
    """Whether this pytest run asked for conformance tests by option; otherwise the plugin
    stays idle (no backend opened, no environment touched) unless its tests are collected."""
    return bool(_option(config, "backend")) or _option(config, "explore") > 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a conformance check of a backend on a case")
    config.addinivalue_line("markers", "conformance_explore: an explore search of a backend")
    timeout = _option(config, "case_timeout")
    if not 0 <= timeout <= MAX_SECONDS:
        raise pytest.UsageError(f"--{PREFIX}-case-timeout {timeout:g}: want seconds from 0 to "
                                f"{MAX_SECONDS} (0: none)")
    if not _asked(config):
        return
    os.environ.update(xdist_worker_environment())  # before anything touches CUDA
    session = _session(config)
    try:
        check_families(session.settings.families)
        select_cases(session.settings.spec(), session.settings.profile)
        for name in session.backend_names:
            session.backend(name)
    except (SpecError, UnknownBackendError, ManifestError, ValueError) as exc:
        raise pytest.UsageError(str(exc)) from None


class ConformanceSession:
    """The backends, settings and the current case's trial, shared by the tests of a run."""

    def __init__(self, config: pytest.Config):
        families = tuple(_option(config, "check")) or tuple(CHECK_FAMILIES)
        self.settings = RunSettings(profile=_option(config, "profile"),
                                    spec_path=_option(config, "spec"), families=families,
                                    manifest_dir=_option(config, "expectations"),
                                    isolated=not _option(config, "in_process"),
                                    case_timeout=_option(config, "case_timeout"))
        self.backend_names = _option(config, "backend") or [DEFAULT_BACKEND]
        self.allow_empty = _option(config, "allow_empty")
        self._backends: dict[str, BackendRun] = {}
        self._trial: tuple[tuple[str, str], Trial] | None = None
        self.selected: dict[str, list[Case]] = {}  # backend name -> the cases its tests run
        self._claims: dict[str, str] = {}  # backend name -> '' or why it claims none of them

    def claims_nothing(self, name: str) -> str:
        """Why the backend's selected tests judge nothing (unavailable, or it claims none of
        their cases), or '' when it claims some: then an unsupported case is a skip."""
        if name not in self._claims:
            backend = self.backend(name)
            if backend.reason:
                why = f"backend {backend.label} is unavailable here: {backend.reason}"
            else:
                handle = backend.connect(self.settings.isolated)
                cases = self.selected.get(name, [])
                claimed = any(handle.unsupported_reason(case) is None for case in cases)
                why = "" if claimed else (
                    f"backend {backend.label} claims none of the {len(cases)} selected cases: "
                    f"it claims {backend.capabilities.summary()}")
            self._claims[name] = why
        return self._claims[name]

    def backend(self, name: str) -> BackendRun:
        if name not in self._backends:
            self._backends[name] = open_backend(name, self.settings.manifest_dir,
                                                self.settings.isolated,
                                                self.settings.case_timeout or None)
        return self._backends[name]

    def trial(self, backend: BackendRun, case: Case) -> Trial | None:
        """One trial per (backend, case): the families of a case share its decode runs. Each
        test (one family) starts the case clock again."""
        if backend.reason is not None:
            return None
        handle = backend.connect(self.settings.isolated)
        handle.begin_case(self.settings.case_timeout, case.id)
        key = (backend.label, case.id)
        if self._trial is None or self._trial[0] != key:
            self._trial = (key, Trial(handle, case))
        return self._trial[1]

    def close(self) -> None:
        for backend in self._backends.values():
            backend.disconnect()


def _session(config: pytest.Config) -> ConformanceSession:
    if not hasattr(config, "_conformance"):
        config._conformance = ConformanceSession(config)
    return config._conformance


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_conformance"):
        config._conformance.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "explore_backend" in metafunc.fixturenames:
        names = _session(metafunc.config).backend_names
        metafunc.parametrize("explore_backend", names, ids=[f"explore/{n}" for n in names])
        return
    if "conformance_item" not in metafunc.fixturenames:
        return
    session = _session(metafunc.config)
    settings = session.settings
    cases = select_cases(settings.spec(), settings.profile)
    labels = [session.backend(name).label for name in session.backend_names]
    params, ids = [], []
    for name, label in zip(session.backend_names, labels, strict=True):
        for case in cases:
            for family in settings.families:
                params.append((name, case, family))
                ids.append(f"{label}/{case.id}/{family}")
    metafunc.parametrize("conformance_item", params, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    exploring = _option(config, "explore") > 0
    wanted = "conformance_explore" if exploring else "conformance"

    def keep(item: pytest.Item) -> bool:
        if item.get_closest_marker("conformance_explore"):
            return exploring
        return bool(item.get_closest_marker(wanted)) or not (
            _option(config, "backend") or exploring)

    selected = [item for item in items if keep(item)]
    deselected = [item for item in items if not keep(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they do
def pytest_collection_finish(session: pytest.Session) -> None:
    if not hasattr(session.config, "_conformance"):
        return  # no conformance test was collected: nothing to prepare
    conformance = _session(session.config)
    for item in session.items:
        params = getattr(item, "callspec", None)
        if params is not None and "conformance_item" in params.params:
            name, case, _ = params.params["conformance_item"]
            cases = conformance.selected.setdefault(name, [])
            if not cases or cases[-1] is not case:
                cases.append(case)


@pytest.fixture
def conformance_session(request: pytest.FixtureRequest) -> ConformanceSession:
    return _session(request.config)


def check_item(session: ConformanceSession, name: str, case: Case, family: str,
               node: pytest.Item | None = None) -> None:
    """Run one family and turn its results into a pytest outcome; what the backend printed
    becomes a section of the test's report."""
    backend = session.backend(name)
    results = evaluate(backend, case, family, session.settings, session.trial(backend, case))
    captured = backend.handle.end_case() if backend.handle is not None else None
    if captured is not None and node is not None:
        node.add_report_section("call", "backend output", f"{captured.total_bytes} bytes, the "
                                f"last {len(captured.tail)} characters:\n{captured.tail}")
    failing = [r for r in results if r.status in FAILING]
    if failing:
        lines = []
        for r in failing:
            measured = f" [error {r.error:.3g}, budget {r.budget:.3g}]" if (
                r.error is not None and r.budget is not None) else ""
            lines.append(f"{r.status.upper()} {r.check}{measured}: {r.message}")
        pytest.fail("\n".join(lines) + f"\nrerun: {failing[0].reproducer}", pytrace=False)
    statuses = {r.status for r in results}
    if statuses == {Status.UNSUPPORTED}:
        empty = session.claims_nothing(name)
        if empty and not session.allow_empty:  # nothing judged is no pass (as in the CLI)
            pytest.fail(f"{empty}; pass --conformance-allow-empty if that is meant",
                        pytrace=False)
        pytest.skip(f"unsupported: {results[0].message}")
    unjudged = [r for r in results if r.status == Status.CANNOT_JUDGE]
    if unjudged:  # no pass: the check could not have failed here
        pytest.skip(f"cannot judge: {unjudged[0].check}: {unjudged[0].message}")
    known = [r for r in results if r.status == Status.KNOWN_FAILURE]
    if known and Status.PASSED not in statuses:
        pytest.xfail(f"known failure: {known[0].message}")
    if known:
        pytest.xfail(f"{len(known)} known failure(s) among {len(results)} checks: "
                     f"{known[0].check}: {known[0].message}")


def explore_item(session: ConformanceSession, name: str, config: pytest.Config) -> None:
    """Explore one backend; fail with every shrunk failure as a ready spec entry."""
    from conformance.explore import explore

    backend = session.backend(name)
    if backend.reason:
        if not session.allow_empty:
            pytest.fail(f"backend {backend.label} is unavailable here: {backend.reason}; pass "
                        f"--conformance-allow-empty if that is meant", pytrace=False)
        pytest.skip(f"unsupported: backend unavailable: {backend.reason}")
    state = explore(backend, session.settings, _option(config, "explore"),
                    seed=_option(config, "explore_seed"))
    if state.findings:
        entries = [finding.spec_entry(f"explore-{backend.label}-{number}")
                   for number, finding in enumerate(state.findings.values(), start=1)]
        pytest.fail(f"{len(entries)} failing check(s) in {state.examples} examples; keep them "
                    f"as regression cases:\n\n" + "\n".join(entries), pytrace=False)
