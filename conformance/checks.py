"""The checks (docs/design.md §6): functions of a ``Trial``, knowing nothing of any backend.

A ``Trial`` holds what the checks of one (backend, case) share: the problem, the float64
oracle, the budget and the two poisoned decode runs, each computed once. Each check family
is a function returning ``Outcome`` records named ``family/sub-check``; a sub-check that does
not apply to the case (batch order for a batch of one) is simply not emitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from backends.base import AttentionState
from conformance.dtypes import numpy_dtype
from conformance.problem import (
    POISONS,
    LogicalKV,
    Problem,
    logical_kv,
    materialise,
    poisoned_outputs,
)
from conformance.sandbox import BackendHandle, ContractError, describe_exception
from conformance.spec import Case, with_changes
from conformance.tolerances import (
    RATIO,
    Budget,
    lse_error,
    lse_rounding,
    output_error,
    score_rounding,
    table_budget,
)
from references import decode_reference, merge_reference

STATUSES = ("passed", "failed", "error", "unsupported", "known-failure", "unexpected-pass")


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str
    error: float | None = None
    budget: Budget | None = None
    message: str = ""

    @property
    def family(self) -> str:
        return self.check.split("/", 1)[0]


@dataclass
class Run:
    """One decode call: its outputs, or the exception it raised; and what it did to inputs."""

    out: np.ndarray | None = None
    lse: np.ndarray | None = None
    exception: str = ""
    mutated: tuple[str, ...] = ()

    @property
    def state(self) -> AttentionState:
        return AttentionState(out=self.out, lse=self.lse)


class Trial:
    """Everything the checks of one backend on one case share, computed at most once.

    The backend is reached only through its handle, which hands it copies: the problem, the
    oracle and the fingerprints here are never seen by the code under test."""

    def __init__(self, backend: BackendHandle, case: Case):
        self.backend = backend
        self.case = case

    @cached_property
    def logical(self) -> LogicalKV:
        return logical_kv(self.case)

    @cached_property
    def problem(self) -> Problem:
        return materialise(self.case)

    @cached_property
    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        return reference_of(self.problem)

    @cached_property
    def budget(self) -> tuple[Budget, Budget]:
        """(output budget, LSE budget) for this case on this backend."""
        table = table_budget(self.case.dtype, self.backend.capabilities.float32_matmul)
        low_out, low_lse = reference_of(self.problem, numpy_dtype(self.case.dtype))
        ref_out, ref_lse = self.reference
        # a second float32 oracle summing in another order: the ratio rule must not rest on
        # one lucky summation order (found by explore at scores of ~-1e5)
        reordered_out, _ = reference_of(reversed_dims(self.problem), numpy_dtype(self.case.dtype))
        ratio_out = RATIO * max(output_error(low_out, ref_out),
                                output_error(reordered_out[..., ::-1], ref_out))
        ratio_lse = RATIO * lse_error(low_lse, ref_lse)  # inf where that oracle overflowed
        ratio_lse = max(ratio_lse if math.isfinite(ratio_lse) else 0.0,
                        self.lse_rounding(ref_lse))
        return Budget(table, ratio_out), Budget(table, ratio_lse)

    def lse_rounding(self, lse: np.ndarray) -> float:
        """What float32 rounding of the scores alone may move the LSE (``lse_rounding``)."""
        problem = self.problem
        heads = np.arange(problem.num_qo_heads) // problem.group_size
        keys = []
        for b in range(problem.batch):
            kept = problem.kept(b)
            pages = problem.block_table[b, kept // problem.page_size]
            keys.append(problem.k_pages[pages, kept % problem.page_size]
                        .astype(np.float64)[:, heads])
        return lse_rounding(score_rounding(problem.q.astype(np.float64), keys,
                                           problem.sm_scale), lse)

    @property
    def empty_lse(self) -> float:
        return self.backend.conventions.empty_lse_natural

    @property
    def has(self) -> frozenset[str]:
        return self.backend.capabilities.features

    def decode(self, problem: Problem, poison: float = POISONS[0],
               num_splits: int | None = None, meanwhile: Callable[[], object] | None = None
               ) -> Run:
        """One poisoned decode call; ``meanwhile`` runs here while the backend works."""
        out, lse = poisoned_outputs(problem, poison)
        try:
            result = self.backend.submit_decode(
                problem, out, lse, num_splits if num_splits else self.case.num_splits)
        except Exception as exc:  # a backend fault is a result, not a crash of the run
            return Run(exception=describe_exception(exc))
        if meanwhile is not None:
            meanwhile()
        try:
            out, lse, mutated = result()
        except Exception as exc:
            return Run(exception=describe_exception(exc))
        return Run(out=out, lse=lse, mutated=mutated)

    @cached_property
    def first_run(self) -> Run:
        # the backend gets its own copy of the problem; the oracle works on this one meanwhile
        return self.decode(self.problem, POISONS[0], meanwhile=lambda: self.budget)

    @cached_property
    def second_run(self) -> Run:
        return self.decode(self.problem, POISONS[1])

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        """The backend's merge; a result outside the contract raises ``ContractError``."""
        return self.backend.merge(a, b)

    def empty_state(self) -> AttentionState:
        shape = self.problem.q.shape
        return AttentionState(out=np.zeros(shape, dtype=self.problem.dtype),
                              lse=np.full(shape[:2], self.empty_lse, dtype=np.float32))

    def compare(self, check: str, got: AttentionState, want_out: np.ndarray,
                want_lse: np.ndarray | None, scale: float = 1.0, what: str = "") -> Outcome:
        """Outcome of comparing a state with a wanted one, output and (if any) LSE."""
        out_budget, lse_budget = (b.scaled(scale) for b in self.budget)
        out_err = output_error(got.out, want_out)
        worst = (out_err, out_budget, "output")
        if want_lse is not None and "lse" in self.has:
            lse_err = lse_error(got.lse, want_lse, self.empty_lse)
            if lse_err / lse_budget.value > out_err / out_budget.value:
                worst = (lse_err, lse_budget, "lse")
        error, budget, name = worst
        passed = error <= budget.value
        message = ""
        if not passed and name == "lse":
            message = _lse_message(got.lse, want_lse, error, budget, self.empty_lse)
            message += f" ({what})" if what else ""
        elif not passed:
            message = (f"output error {error:.3g} > budget {budget.value:.3g}"
                       f"{' (' + what + ')' if what else ''}{locate(got.out, want_out)}")
        return Outcome(check, "passed" if passed else "failed", error, budget, message)


def reversed_dims(problem: Problem) -> Problem:
    """The same problem with head_dim reversed in q, K and V: the same answer (its output
    reversed), summed in another order."""
    return replace(problem, q=problem.q[..., ::-1], k_pages=problem.k_pages[..., ::-1],
                   v_pages=problem.v_pages[..., ::-1])


def reference_of(problem: Problem, precision: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    return decode_reference(problem.q, problem.k_pages, problem.v_pages, problem.block_table,
                            problem.context_lens, sm_scale=problem.sm_scale,
                            window=problem.window, sinks=problem.sinks, precision=precision)


def locate(got: np.ndarray, want: np.ndarray) -> str:
    """Where the worst output element is, as ' at [batch, head]: got X, want Y'."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.size == 0:
        return ""
    diff = np.where(np.isfinite(got), np.abs(got - want), np.inf)
    b, h, d = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return f" at [batch {b}, head {h}, dim {d}]: got {got[b, h, d]:.6g}, want {want[b, h, d]:.6g}"


def fault_outcome(check: str, exc: Exception) -> Outcome:
    """A sub-check that raised: ``failed`` when the backend broke the contract, else ``error``."""
    status = "failed" if isinstance(exc, ContractError) else "error"
    return Outcome(check, status, message=describe_exception(exc))


def errored(check: str, run: Run) -> Outcome | None:
    return Outcome(check, "error", message=run.exception) if run.exception else None


def unsupported(check: str, reason: str) -> Outcome:
    return Outcome(check, "unsupported", message=reason)


# Offsets from a case's seed for the layouts the checks make, so no two draw the same pages.
SEEDS = {"wide-table": 1, "reshuffle": 2, "batch-order": 3, "neighbours": 4,
         "neighbour-layout": 5, "gqa-as-mha": 6, "page-size": 7, "segment": 10}


def seed(case: Case, use: str) -> int:
    return case.seed + SEEDS[use]


# --- families --------------------------------------------------------------------------------


def check_oracle(trial: Trial) -> list[Outcome]:
    """Output and LSE against the float64 oracle, within the dtype's budget."""
    run = trial.first_run
    if run.exception:
        return [errored("oracle/output", run), errored("oracle/lse", run)]
    ref_out, ref_lse = trial.reference
    outcomes = [trial.compare("oracle/output", run.state, ref_out, None)]
    if "lse" in trial.has:
        _out_budget, lse_budget = trial.budget
        error = lse_error(run.lse, ref_lse, trial.empty_lse)
        passed = error <= lse_budget.value
        message = "" if passed else _lse_message(run.lse, ref_lse, error, lse_budget,
                                                 trial.empty_lse)
        outcomes.append(Outcome("oracle/lse", "passed" if passed else "failed", error,
                                lse_budget, message))
    else:
        outcomes.append(unsupported("oracle/lse", "feature lse not in capabilities"))
    return outcomes


def _lse_message(got: np.ndarray, want: np.ndarray, error: float, budget: Budget,
                 empty: float) -> str:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    want_empty = np.isneginf(want64) | (np.isclose(want64, empty, rtol=1e-6, atol=0.0)
                                        if math.isfinite(empty) else False)
    bad = np.isnan(got64) | (want_empty & ~np.isclose(got64, empty, rtol=1e-6)
                             & ~(np.isneginf(got64) & math.isinf(empty)))
    if not bad.any():
        with np.errstate(invalid="ignore"):
            diff = np.where(want_empty, 0.0, np.nan_to_num(np.abs(got64 - want64), nan=np.inf))
        bad = diff == diff.max()
    b, h = (int(i) for i in np.argwhere(bad)[0])
    return (f"lse error {error:.3g} > budget {budget.value:.3g} at [batch {b}, head {h}]: got "
            f"{got64[b, h]:.8g}, want {want64[b, h]:.8g}")


def check_poison(trial: Trial) -> list[Outcome]:
    """Every output and LSE slot is written (two runs, two poisons), and NaN in the slots a
    kernel must not read never reaches an output."""
    return [_unwritten(trial), _masked_nan(trial)]


def _masked_nan(trial: Trial) -> Outcome:
    """The same problem with NaN, not garbage, where nothing may be read: reading masked slots
    and zeroing their weight passes ``oracle`` but turns this NaN into output."""
    check = "poison/masked-nan"
    problem = materialise(trial.case, masked="nan")
    run = trial.decode(problem, POISONS[1])
    if run.exception:
        return errored(check, run)
    bad_out = np.isnan(np.asarray(run.out, dtype=np.float64)).any(axis=-1)
    bad = bad_out | np.isnan(run.lse)
    if not bad.any():
        return Outcome(check, "passed")
    b, h = (int(i) for i in np.argwhere(bad)[0])
    return Outcome(check, "failed", message=(
        f"NaN in the slots the kernel must not read reached {int(bad.sum())} (batch, head) "
        f"rows of output or LSE (first at [batch {b}, head {h}]); with finite values there "
        f"the kernel is judged by oracle, so it reads masked slots and weights them by zero"))


def _unwritten(trial: Trial) -> Outcome:
    check = "poison/unwritten"
    problems = []
    for run, poison in ((trial.first_run, POISONS[0]), (trial.second_run, POISONS[1])):
        if run.exception:
            return errored(check, run)
        for name, array in (("output", run.out), ("lse", run.lse)):
            values = np.asarray(array, dtype=np.float64)
            stale = np.isnan(values) if math.isnan(poison) else values == poison
            if stale.any():
                where = np.argwhere(stale)[0].tolist()
                problems.append(f"{int(stale.sum())} {name} slots still hold poison {poison} "
                                f"(first at index {where})")
    if problems:
        return Outcome(check, "failed", message="; ".join(problems))
    return Outcome(check, "passed")


def check_purity(trial: Trial) -> list[Outcome]:
    """The inputs are bit-for-bit the same after the call."""
    for run in (trial.first_run, trial.second_run):
        if run.exception:
            return [errored("purity", run)]
        if run.mutated:
            return [Outcome("purity", "failed",
                            message=f"decode modified its inputs: {', '.join(run.mutated)}")]
    return [Outcome("purity", "passed")]


def check_determinism(trial: Trial) -> list[Outcome]:
    """The same call twice gives the same bits (or, if declared nondeterministic, close)."""
    a, b = trial.first_run, trial.second_run
    if a.exception or b.exception:
        return [errored("determinism", a if a.exception else b)]
    if not trial.backend.capabilities.deterministic:
        outcome = trial.compare("determinism", b.state, a.out, a.lse, what="second call")
        return [outcome]
    same = a.out.tobytes() == b.out.tobytes() and a.lse.tobytes() == b.lse.tobytes()
    if same:
        return [Outcome("determinism", "passed", 0.0)]
    error = output_error(b.out, a.out)
    return [Outcome("determinism", "failed", error,
                    message=f"two identical calls differ (output error {error:.3g})"
                            f"{locate(b.out, a.out)}")]


# --- merge -----------------------------------------------------------------------------------


def _cuts(kept: int, page_size: int, scheme: str) -> list[int]:
    """Cut points over the kept tokens of one row (duplicates make empty segments)."""
    if scheme == "page":
        third = max(1, kept // 3 // page_size) * page_size
        return [0, min(third, kept), min(2 * third, kept), kept]
    if scheme == "inside-page":
        inside = (kept // 2 // page_size) * page_size + max(1, page_size // 2)
        return [0, min(inside, kept), kept]
    half = kept // 2
    return [0, 0, half, half, kept]


def segment_states(trial: Trial, scheme: str) -> list[AttentionState] | str:
    """Decode the kept tokens cut into segments; returns the states or an error message."""
    logical, problem = trial.logical, trial.problem
    kept = [problem.kept(b) for b in range(problem.batch)]
    cuts = [_cuts(len(k), problem.page_size, scheme) for k in kept]
    count = len(cuts[0]) - 1

    def segment(j: int) -> Problem:
        rows = [k[c[j]:c[j + 1]] for k, c in zip(kept, cuts, strict=True)]
        keys = tuple(k[r] for k, r in zip(logical.keys, rows, strict=True))
        values = tuple(v[r] for v, r in zip(logical.values, rows, strict=True))
        part = LogicalKV(q=logical.q, keys=keys, values=values, sm_scale=logical.sm_scale)
        return part.lay_out(problem.page_size, seed(trial.case, "segment") + j)

    states, laid = [], [segment(0)]
    for j in range(count):
        # lay out the next segment while the backend decodes this one
        run = trial.decode(laid[j], meanwhile=(lambda j=j: laid.append(segment(j + 1)))
                           if j + 1 < count else None)
        if run.exception:
            return f"segment {j} ({scheme} cuts): {run.exception}"
        states.append(run.state)
    return states


def _fold(trial: Trial, states: list[AttentionState]) -> AttentionState:
    merged = states[0]
    for state in states[1:]:
        merged = trial.merge(merged, state)
    return merged


def check_merge(trial: Trial) -> list[Outcome]:
    """Split-K equivalence with the backend's merge, and the merge's algebra."""
    missing = {"lse", "merge"} - trial.has
    if missing:
        return [unsupported("merge", f"feature {', '.join(sorted(missing))} not in capabilities")]
    base = trial.first_run
    if base.exception:
        return [errored("merge", base)]
    ref_out, ref_lse = trial.reference
    outcomes: list[Outcome] = []
    pieces: dict[str, list[AttentionState]] = {}
    for scheme in ("page", "inside-page", "empty-segments"):
        check = f"merge/segments-{scheme}"
        try:
            states = segment_states(trial, scheme)
            if isinstance(states, str):
                outcomes.append(Outcome(check, "error", message=states))
                continue
            pieces[scheme] = states
            merged = _fold(trial, states)
            outcome = trial.compare(check, merged, ref_out, ref_lse, scale=len(states),
                                    what=f"{len(states)} segments merged vs oracle")
            outcomes.append(outcome)
        except Exception as exc:
            outcomes.append(fault_outcome(check, exc))
    empty = trial.empty_state()
    algebra: list[tuple[str, Callable[[], Outcome]]] = [
        ("merge/identity", lambda: _identity(trial, base.state, empty)),
        ("merge/both-empty", lambda: _both_empty(trial, empty)),
    ]
    if "page" in pieces:
        a, b, c = pieces["page"]
        algebra += [
            ("merge/commutative", lambda: trial.compare(
                "merge/commutative", trial.merge(b, a), *_as_pair(trial.merge(a, b)),
                what="merge(b, a) vs merge(a, b)")),
            ("merge/associative", lambda: trial.compare(
                "merge/associative", trial.merge(a, trial.merge(b, c)),
                *_as_pair(trial.merge(trial.merge(a, b), c)), scale=2,
                what="tree vs left-to-right")),
            ("merge/lse-gap", lambda: _lse_gap(trial, a, b)),
        ]
    return outcomes + run_each(algebra)


def _as_pair(state: AttentionState) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(state.out, dtype=np.float64), state.lse


def _identity(trial: Trial, state: AttentionState, empty: AttentionState) -> Outcome:
    for order, merged in (("merge(x, empty)", trial.merge(state, empty)),
                          ("merge(empty, x)", trial.merge(empty, state))):
        outcome = trial.compare("merge/identity", merged, *_as_pair(state), what=order)
        if outcome.status != "passed":
            return outcome
    return outcome


def _both_empty(trial: Trial, empty: AttentionState) -> Outcome:
    merged = trial.merge(empty, replace(empty, out=empty.out.copy(), lse=empty.lse.copy()))
    out = np.asarray(merged.out, dtype=np.float64)
    error = lse_error(merged.lse, np.full(merged.lse.shape, -np.inf), trial.empty_lse)
    if np.isnan(out).any() or np.any(out != 0) or not math.isfinite(error):
        return Outcome("merge/both-empty", "failed", math.inf, message=(
            f"merge(empty, empty) gave {int(np.isnan(out).sum())} NaN and "
            f"{int(np.sum(np.nan_to_num(out) != 0))} non-zero output values, LSE "
            f"{float(merged.lse.flat[0])!r}; want 0 and {trial.empty_lse!r}"))
    return Outcome("merge/both-empty", "passed", 0.0)


def _lse_gap(trial: Trial, a: AttentionState, b: AttentionState) -> Outcome:
    """States whose LSEs differ by more than 100, and states at |LSE| ~ 3e4."""
    live = np.isfinite(a.lse) & np.isfinite(b.lse) & (a.lse != trial.empty_lse) & \
        (b.lse != trial.empty_lse)
    worst: Outcome | None = None
    for shift_a, shift_b in ((150.0, 0.0), (0.0, 150.0), (3e4, 3e4 - 120.0)):
        sa = AttentionState(out=a.out, lse=np.where(live, a.lse + np.float32(shift_a), a.lse)
                            .astype(np.float32))
        sb = AttentionState(out=b.out, lse=np.where(live, b.lse + np.float32(shift_b), b.lse)
                            .astype(np.float32))
        ref_out, ref_lse = merge_reference(sa.out, np.where(live, sa.lse, -np.inf), sb.out,
                                           np.where(live, sb.lse, -np.inf))
        merged = trial.merge(sa, sb)
        keep = np.where(live[..., None], merged.out, 0)
        want = np.where(live[..., None], ref_out, 0)
        outcome = trial.compare("merge/lse-gap", AttentionState(keep, np.where(
            live, merged.lse, trial.empty_lse).astype(np.float32)), want, ref_lse,
            what=f"LSE shifted by {shift_a:g} and {shift_b:g}")
        if worst is None or outcome.status != "passed":
            worst = outcome
        if outcome.status != "passed":
            break
    return worst


# --- invariances -----------------------------------------------------------------------------


def check_invariance(trial: Trial) -> list[Outcome]:
    """Metamorphic checks: what must not change the answer."""
    base = trial.first_run
    if base.exception:
        return [errored("invariance", base)]
    case, logical, problem = trial.case, trial.logical, trial.problem
    pad, shared = case.table_padding, case.shared_pages
    variants: list[tuple[str, Callable[[], Outcome]]] = [
        ("invariance/reshuffle", lambda: _same_answer(
            trial, "invariance/reshuffle",
            logical.lay_out(case.page_size, seed(case, "reshuffle"), pad, shared))),
        ("invariance/wide-table", lambda: _same_answer(
            trial, "invariance/wide-table",
            logical.lay_out(case.page_size, seed(case, "wide-table"), pad + 50, shared))),
        ("invariance/neighbours", lambda: _neighbours(trial)),
    ]
    if problem.batch > 1:
        order = list(range(problem.batch))[::-1]
        variants.append(("invariance/batch-order", lambda: _same_answer(
            trial, "invariance/batch-order",
            logical.select(order).lay_out(case.page_size, seed(case, "batch-order"), pad),
            rows=order)))
    if problem.group_size > 1:
        variants.append(("invariance/gqa-as-mha", lambda: _as_mha(trial)))
    if "split_k" in trial.has:
        for count in trial.backend.capabilities.split_counts:
            variants.append((f"invariance/split-count-{count}", lambda count=count: _same_answer(
                trial, f"invariance/split-count-{count}", problem, num_splits=count)))
    else:
        variants.append(("invariance/split-count",
                         lambda: unsupported("invariance/split-count",
                                             "feature split_k not in capabilities")))
    variants.append(("invariance/page-size", lambda: _other_page_size(trial)))
    return run_each(variants)


def run_each(checks: list[tuple[str, Callable[[], Outcome]]]) -> list[Outcome]:
    """Run sub-checks; one that raises is an ``error`` outcome and the others still run."""
    outcomes = []
    for check, run_check in checks:
        try:
            outcomes.append(run_check())
        except Exception as exc:  # a backend fault is a result
            outcomes.append(fault_outcome(check, exc))
    return outcomes


def _same_answer(trial: Trial, check: str, problem: Problem, rows: list[int] | None = None,
                 num_splits: int | None = None, keep: list[int] | None = None) -> Outcome:
    """Decode a re-laid problem and compare with the base run: base rows ``rows`` (all by
    default) against the new problem's rows ``keep`` (all by default)."""
    run = trial.decode(problem, num_splits=num_splits)
    if run.exception:
        return Outcome(check, "error", message=run.exception)
    base = trial.first_run
    want_out, want_lse = base.out, base.lse
    if rows is not None:
        want_out, want_lse = want_out[rows], want_lse[rows]
    got = run.state
    if keep is not None:
        got = AttentionState(run.out[keep], run.lse[keep])
    return trial.compare(check, got, np.asarray(want_out, np.float64), want_lse,
                         what=check.split("/", 1)[1])


def _neighbours(trial: Trial) -> Outcome:
    """Each sequence gets new neighbours (fresh sequences of other lengths between its rows)."""
    logical, case = trial.logical, trial.case
    rng = np.random.default_rng(seed(case, "neighbours"))
    dtype = logical.q.dtype
    q, keys, values, keep = [], [], [], []
    for b in range(len(logical.keys)):
        n = int(rng.integers(0, 3 * case.page_size + 5))
        q.append(rng.standard_normal(logical.q.shape[1:]).astype(dtype))
        keys.append(rng.standard_normal((n, *logical.keys[b].shape[1:])).astype(dtype))
        values.append(rng.standard_normal((n, *logical.keys[b].shape[1:])).astype(dtype))
        keep.append(len(q))
        q.append(logical.q[b])
        keys.append(logical.keys[b])
        values.append(logical.values[b])
    mixed = LogicalKV(q=np.stack(q), keys=tuple(keys), values=tuple(values),
                      sm_scale=logical.sm_scale, window=logical.window, sinks=logical.sinks)
    problem = mixed.lay_out(case.page_size, seed(case, "neighbour-layout"),
                             case.table_padding)
    return _same_answer(trial, "invariance/neighbours", problem, keep=keep)


def _as_mha(trial: Trial) -> Outcome:
    """KV heads repeated so that every query head has its own: GQA as MHA."""
    case, logical, g = trial.case, trial.logical, trial.problem.group_size
    reason = trial.backend.unsupported_reason(with_changes(case, num_kv_heads=case.num_qo_heads))
    if reason:
        return unsupported("invariance/gqa-as-mha", reason)
    mha = LogicalKV(q=logical.q, keys=tuple(np.repeat(k, g, axis=1) for k in logical.keys),
                    values=tuple(np.repeat(v, g, axis=1) for v in logical.values),
                    sm_scale=logical.sm_scale, window=logical.window, sinks=logical.sinks)
    return _same_answer(trial, "invariance/gqa-as-mha",
                        mha.lay_out(case.page_size, seed(case, "gqa-as-mha"), case.table_padding))


def _other_page_size(trial: Trial) -> Outcome:
    case = trial.case
    candidates = [case.page_size * 2, max(1, case.page_size // 2), 16, 1]
    for size in candidates:
        if size != case.page_size and not trial.backend.unsupported_reason(
                with_changes(case, page_size=size)):
            problem = trial.logical.lay_out(size, seed(case, "page-size"), case.table_padding)
            return _same_answer(trial, "invariance/page-size", problem)
    return unsupported("invariance/page-size", "no other page size in capabilities")


CHECK_FAMILIES: dict[str, Callable[[Trial], list[Outcome]]] = {
    "oracle": check_oracle,
    "poison": check_poison,
    "purity": check_purity,
    "determinism": check_determinism,
    "merge": check_merge,
    "invariance": check_invariance,
}
