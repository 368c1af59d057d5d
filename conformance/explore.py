"""Explore: search the space a backend claims for cases that fail, and shrink each to a spec entry.

Hypothesis draws cases (``conformance.strategies``), the same check families as ``run``
judge each one through the same isolated worker, and a failure is raised as an exception
named for the sub-check it failed, so Hypothesis shrinks each distinct failure to the
smallest case that still fails *that* check.

With a database folder (``--database DIR``) the findings of earlier searches of the backend
(``DIR/<backend>.toml``, a regression spec) are replayed first and kept while they fail; the
search then looks for others. Hypothesis's own database stays off: every search is seeded
(the same seed draws the same cases), and a seeded search saves nothing. Hypothesis's caches go
to ``DIR/hypothesis``, or to a temporary folder: nothing is written to the current folder.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from conformance.result import Result
from conformance.runner import evaluate_case
from conformance.session import BackendRun, RunSettings
from conformance.spec import Case
from conformance.status import BROKEN

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
    interrupted: bool = False  # Ctrl-C or a timeout's TERM: what was found so far stands
    rounds: int = 0
    replayed: int = 0  # saved findings replayed from the database
    still_failing: int = 0  # of those, how many fail again
    # the judged (claimed) examples per kind and variant, so that a report says how much of
    # the space it reached: MLA and GQA, then each feature and fp8
    judged: Counter[str] = field(default_factory=Counter)


def variants_of(case: Case) -> list[str]:
    """The kind of a case and the variants it exercises, as ``Exploration.judged`` counts."""
    return [case.kind, *sorted(case.features), *(["fp8"] if case.kv_dtype else [])]


@contextlib.contextmanager
def hypothesis_home(database: Path | None) -> Iterator[None]:
    """Hypothesis keeps caches in ``.hypothesis/`` of the current folder unless told: the
    database folder, or a temporary one."""
    from hypothesis.configuration import set_hypothesis_home_dir

    with contextlib.ExitStack() as stack:
        home = database / "hypothesis" if database else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="conformance-hypothesis-")))
        set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


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
    for optional in ("num_splits", "shared_pages", "pool_pages"):
        if getattr(case, optional):
            fields[optional] = getattr(case, optional)
    if case.kv_dtype is not None:
        fields.update(kv_dtypes=[case.kv_dtype], kv_scale=case.kv_scale,
                      kv_scaling=case.kv_scaling)
    if case.q_dtype is not None:
        fields["q_dtypes"] = [case.q_dtype]
    if case.soft_cap is not None:
        fields["soft_cap"] = case.soft_cap
    if case.sink_logits is not None:
        fields["sink_logits"] = case.sink_logits if isinstance(case.sink_logits, str) else \
            list(case.sink_logits)
    if case.alibi:
        fields["alibi"] = True if case.alibi is True else list(case.alibi)
    if case.query_lens is not None:
        fields["query_lens"] = list(case.query_lens)
        if case.mask != Case.mask:
            fields["mask"] = case.mask
    if case.table_padding != Case.table_padding:
        fields["table_padding"] = case.table_padding
    fields["seed"] = case.seed  # the values drawn, whatever the entry is named
    fields["dtypes"] = [case.dtype]

    def toml(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
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
            database: Path | None = None, cost_cap: int | None = None,
            progress: Callable[[Exploration, float | None], None] | None = None,
            observe: Callable[[Case], None] | None = None,
            clock: Callable[[], float] = time.monotonic, fp8: bool = False) -> Exploration:
    """Draw up to ``max_examples`` cases the backend claims, judge each, shrink failures.
    ``clock`` measures the time budget (a test gives one that does not depend on the
    machine's speed); ``fp8`` draws only cases with an fp8 cache."""
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import seed as hyp_seed
    from hypothesis import settings as hyp_settings
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
    strategy = cases(backend.capabilities, cap, fp8=fp8)
    saved = database / f"{backend.label}.toml" if database else None
    if saved is not None and saved.exists():
        replay_saved(saved, backend, settings, state)

    def search(round_seed: int, examples: int, known: frozenset[str]) -> None:
        @hyp_seed(round_seed)
        @hyp_settings(max_examples=examples, deadline=None, derandomize=False, database=None,
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
            state.judged.update(variants_of(case))
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
        with hypothesis_home(database):
            for round_number in range(max_examples):
                before = len(state.findings)
                search(seed + round_number, max_examples - state.examples,
                       frozenset(state.findings))
                state.rounds += 1
                if len(state.findings) == before or state.examples >= max_examples:
                    break
    except TimeBudgetSpent:
        pass  # the smallest case of each finding so far stands
    except KeyboardInterrupt:  # as for the time budget: report what was found, not a traceback
        state.interrupted = True
    finally:
        state.seconds = clock() - started
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.unlink(missing_ok=True)  # what still fails, and what is new
        if state.findings:
            save_spec(saved, named_entries(state, backend.label))
    return state


def replay_saved(path: Path, backend: BackendRun, settings: RunSettings,
                 state: Exploration) -> None:
    """The findings an earlier search saved: each that still fails is a finding again."""
    from conformance.spec import load_spec

    for case in load_spec(path).cases(REGRESSION_PROFILE):
        state.replayed += 1
        if backend.handle.unsupported_reason(case):
            continue
        record = evaluate_case(backend, case, settings)
        broken = [r for r in record.results if r.status in BROKEN
                  and r.check not in state.findings]
        if broken:
            state.still_failing += 1
            state.findings[broken[0].check] = Finding(broken[0].check, case, broken[0])


def named_entries(state: Exploration, label: str) -> list[str]:
    """Each finding as a spec entry, named for the backend, the check and its number."""
    return [finding.spec_entry(entry_name(label, finding, number))
            for number, finding in enumerate(state.findings.values(), start=1)]


def entry_name(label: str, finding: Finding, number: int) -> str:
    return f"explore-{label}-{finding.check.replace('/', '-')}-{number}"


def print_progress(state: Exploration, left: float | None, stream=sys.stderr) -> None:
    if state.examples % 25 == 0:
        budget = f", {left:.0f} s left" if left is not None else ""
        stream.write(f"{state.examples} examples, {len(state.findings)} failing checks"
                     f"{budget}\n")
        stream.flush()
