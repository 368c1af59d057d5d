"""Explore: search the space a backend claims for cases that fail, and shrink each to a spec entry.

Hypothesis draws cases (``conformance.strategies``), the same check families as ``run``
judge each one through the same isolated worker, and a failure is raised as an exception
named for the sub-check it failed, so Hypothesis shrinks each distinct failure to the
smallest case that still fails *that* check. Failures found before are replayed first from
Hypothesis's example database (``.hypothesis/conformance/`` by default).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conformance.runner import BackendRun, Result, RunSettings, evaluate_case
from conformance.spec import Case
from conformance.status import BROKEN

DEFAULT_DATABASE = Path(".hypothesis") / "conformance"
REGRESSION_PROFILE = "regressions"


class CheckFailedError(Exception):
    """A drawn case failed a check; subclassed per sub-check so each shrinks on its own."""


class TimeBudgetSpent(BaseException):
    """Ends the search when the time budget is spent: a BaseException, which Hypothesis
    neither records as a failure nor shrinks (it lets it through, as KeyboardInterrupt)."""


_FAILURE_TYPES: dict[str, type[CheckFailedError]] = {}


def failure_type(check: str) -> type[CheckFailedError]:
    if check not in _FAILURE_TYPES:
        _FAILURE_TYPES[check] = type(f"Failed[{check}]", (CheckFailedError,), {})
    return _FAILURE_TYPES[check]


@dataclass
class Finding:
    """The smallest case found failing one sub-check, with the result that says how."""

    check: str
    case: Case
    result: Result

    def spec_entry(self, name: str) -> str:
        return spec_entry(name, self.case, f"found by explore: {self.check} "
                                           f"({self.result.status}): {self.result.message}")


@dataclass
class Exploration:
    backend: str
    examples: int = 0
    seconds: float = 0.0
    findings: dict[str, Finding] = field(default_factory=dict)
    stopped_early: bool = False
    rounds: int = 0


def spec_entry(name: str, case: Case, doc: str) -> str:
    """A ``[[family]]`` TOML entry that expands to exactly this case."""
    fields = {"num_qo_heads": case.num_qo_heads, "num_kv_heads": case.num_kv_heads,
              "head_dim": case.head_dim, "page_size": case.page_size,
              "context_lens": list(case.context_lens), "distribution": case.distribution}
    if case.window is not None:
        fields["window"] = case.window
    if case.sinks:
        fields["sinks"] = case.sinks
    if case.sm_scale is not None:
        fields["sm_scale"] = case.sm_scale
    for optional in ("num_splits", "shared_pages"):
        if getattr(case, optional):
            fields[optional] = getattr(case, optional)
    if case.table_padding != Case.table_padding:
        fields["table_padding"] = case.table_padding
    fields["seed"] = case.seed  # the values drawn, whatever the entry is named
    fields["dtypes"] = [case.dtype]

    def toml(value: object) -> str:
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, list):
            return "[" + ", ".join(toml(v) for v in value) + "]"
        return repr(value)

    doc = " ".join(doc.split())[:300]
    lines = ["[[family]]", f"name = {toml(name)}", f"doc = {toml(doc)}",
             f'profiles = ["{REGRESSION_PROFILE}"]', "[family.set]"]
    lines += [f"{key} = {toml(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def as_listed(case: Case, name: str) -> Case:
    """The case as the saved spec entry will expand it (its family is the entry's name)."""
    from dataclasses import replace

    return replace(case, family=name, fixed_seed=case.seed)


def save_spec(path: Path, entries: list[str]) -> None:
    """Append entries to a regression spec, writing its header first if it is new."""
    header = "" if path.exists() else (
        "# Regression cases found by `python -m conformance explore`; replay with\n"
        f"# python -m conformance run --spec {path} --profile {REGRESSION_PROFILE}\n\n"
        "schema = 1\n\n"
        f"[profiles.{REGRESSION_PROFILE}]\n"
        'doc = "cases explore found failing, each shrunk to the smallest that still fails"\n')
    with path.open("a", encoding="utf-8") as stream:
        stream.write(header + "".join("\n" + entry for entry in entries))


def explore(backend: BackendRun, settings: RunSettings, max_examples: int = 200,
            time_budget: float | None = None, seed: int = 0,
            database: Path | None = DEFAULT_DATABASE, cost_cap: int | None = None,
            progress: Callable[[Exploration, float | None], None] | None = None,
            observe: Callable[[Case], None] | None = None,
            clock: Callable[[], float] = time.monotonic) -> Exploration:
    """Draw up to ``max_examples`` cases the backend claims, judge each, shrink failures.
    ``clock`` measures the time budget (a test gives one that does not depend on the
    machine's speed)."""
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import seed as hyp_seed
    from hypothesis import settings as hyp_settings
    from hypothesis.database import DirectoryBasedExampleDatabase
    from hypothesis.errors import Flaky

    from conformance.strategies import CPU_COST_CAP, GPU_COST_CAP, cases

    handle = backend.connect(settings.isolated)
    on_gpu = "cuda" in backend.capabilities.devices and handle.device() == "cuda"
    cap = cost_cap or (GPU_COST_CAP if on_gpu else CPU_COST_CAP)
    state = Exploration(backend.label)
    started = clock()

    def over_budget() -> bool:
        return time_budget is not None and clock() - started > time_budget

    # past the time budget the search ends where it is: in generation, or in the shrinking
    # of a failure found before, which then keeps the smallest case failing so far.
    # Hypothesis stops generating at the first failure; to go on searching, each later
    # round (seed + round) treats the checks found failing so far as passing, until a round
    # finds nothing new or the examples or the time run out.
    db = DirectoryBasedExampleDatabase(str(database / backend.label)) if database else None
    strategy = cases(backend.capabilities, cap)

    def search(round_seed: int, examples: int, known: frozenset[str]) -> None:
        @hyp_seed(round_seed)
        @hyp_settings(max_examples=examples, deadline=None, derandomize=False, database=db,
                      suppress_health_check=list(HealthCheck), report_multiple_bugs=True,
                      phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
                      print_blob=False)
        @given(strategy)
        def judge(case: Case) -> None:
            if over_budget():
                state.stopped_early = True
                raise TimeBudgetSpent
            state.examples += 1
            if observe:
                observe(case)
            if progress:
                progress(state, None if time_budget is None else
                         time_budget - (clock() - started))
            if handle.unsupported_reason(case):
                return
            record = evaluate_case(backend, case, settings)
            # failed or erred: a manifest's known failures are not news, nor are its entries
            # that a drawn case happens to pass (patterns are written for listed cases)
            broken = [r for r in record.results if r.status in BROKEN and r.check not in known]
            if broken:
                first = broken[0]
                state.findings[first.check] = Finding(first.check, case, first)
                raise failure_type(first.check)(f"{first.check}: {first.message}")

        try:
            judge()
        except (CheckFailedError, BaseExceptionGroup, Flaky):
            # each finding's smallest case was recorded as Hypothesis replayed it last
            pass

    try:
        for round_number in range(max_examples):
            before = len(state.findings)
            search(seed + round_number, max_examples - state.examples,
                   frozenset(state.findings))
            state.rounds += 1
            if len(state.findings) == before or state.examples >= max_examples:
                break
    except TimeBudgetSpent:
        pass  # the smallest case of each finding so far stands
    finally:
        state.seconds = clock() - started
    return state


def print_progress(state: Exploration, left: float | None, stream=sys.stderr) -> None:
    if state.examples % 25 == 0:
        budget = f", {left:.0f} s left" if left is not None else ""
        stream.write(f"{state.examples} examples, {len(state.findings)} failing checks"
                     f"{budget}\n")
        stream.flush()


def explore_command(args: argparse.Namespace) -> int:
    """``python -m conformance explore``: search, print each finding as a spec entry, save."""
    import json

    from conformance.checks import CHECK_FAMILIES
    from conformance.inputs import check_directory, check_output, write_atomically
    from conformance.interrupts import stop_on_signals
    from conformance.runner import check_families, open_backends

    for option in ("save_spec", "report_json"):
        if getattr(args, option) is not None:
            check_output(getattr(args, option), "--" + option.replace("_", "-"))
    if args.expectations is not None:
        check_directory(args.expectations, "--expectations")
    settings = RunSettings(profile="explore", families=check_families(args.checks or
                                                                      CHECK_FAMILIES),
                           manifest_dir=args.expectations, isolated=not args.in_process,
                           case_timeout=args.case_timeout)
    backend = open_backends([args.backend], args.expectations, isolated=not args.in_process,
                            load_timeout=args.case_timeout or None)[0]
    if backend.reason:
        print(f"error: backend {backend.label!r} is unavailable here: {backend.reason}",
              file=sys.stderr)
        return 2
    stop_on_signals()
    try:
        state = explore(backend, settings, args.max_examples, args.time_budget, args.seed,
                        args.database or DEFAULT_DATABASE, progress=print_progress)
    finally:
        backend.disconnect()
    print(f"\nexplored {backend.label}: {state.examples} examples in {state.seconds:.1f}s"
          f"{' (time budget reached)' if state.stopped_early else ''}, seed {args.seed}, "
          f"{state.rounds} round(s); "
          f"{len(state.findings)} failing check(s)")
    entries, rows = [], []
    for number, finding in enumerate(state.findings.values(), start=1):
        name = f"explore-{backend.label}-{finding.check.replace('/', '-')}-{number}"
        entry = finding.spec_entry(name)
        case_id = as_listed(finding.case, name).id
        spec = args.save_spec or "regressions.toml"
        rerun = (f"python -m conformance run --backend {args.backend} --spec {spec} --profile "
                 f"{REGRESSION_PROFILE} --case '{case_id}'")
        print(f"\n- {finding.result.status.upper()} {finding.check}: {finding.result.message}"
              f"\n  smallest case: {finding.case.id}\n\n{entry}\n  rerun: {rerun}")
        entries.append(entry)
        rows.append({"check": finding.check, "status": finding.result.status,
                     "message": finding.result.message, "case": finding.case.id,
                     "spec_entry": entry, "reproducer": rerun})
    if entries and args.save_spec:
        save_spec(args.save_spec, entries)
        print(f"\nappended {len(entries)} case(s) to {args.save_spec}")
    elif entries:
        print("\nkeep them with --save-spec FILE (a spec that `run --spec FILE` replays)")
    if args.report_json:
        write_atomically(args.report_json, json.dumps(
            {"schema": "paged-decode-conformance/explore/1", "backend": backend.label,
             "seed": args.seed, "examples": state.examples, "seconds": state.seconds,
             "stopped_early": state.stopped_early, "rounds": state.rounds,
             "findings": rows}, indent=1) + "\n")
    return 1 if state.findings else 0
