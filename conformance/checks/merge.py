"""Merge: split-K states merged by the backend's own merge, and the merge's algebra."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from conformance.backends.base import AttentionState
from conformance.checks.outcomes import fault_outcome, run_each, unsupported
from conformance.checks.trial import (
    Job,
    Trial,
    errored,
    seed,
)
from conformance.references import merge_reference
from conformance.result import Result
from conformance.status import Status
from conformance.tolerances import lse_error, merge_rounding


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


def _at_gaps(cuts: list[list[int]], kept: list[np.ndarray]) -> list[list[int]]:
    """Each row's cuts with one more wherever its kept positions jump (first-N sinks, then
    the window; a draft tree's branches not taken), and repeats of its last cut (empty
    segments) up to the most jumps of any row, so segment ``j`` means the same in every
    row."""
    jumps = [np.flatnonzero(np.diff(k) > 1) + 1 for k in kept]
    most = max((j.size for j in jumps), default=0)
    return [sorted([*c, *j.tolist(), *[c[-1]] * (most - j.size)])
            for c, j in zip(cuts, jumps, strict=True)]


SCHEMES = ("page", "inside-page", "empty-segments")


class Segments:
    """The kept tokens of each query row cut into segments by one scheme (``_cuts``).

    Segments are per query row (several query tokens per sequence: each row's own visible
    tokens), each a fresh one-token problem of its tokens alone: no window, no first-N
    sinks, and no sink logits (applied once to the merged state, ``Trial.with_sink``). With
    ALiBi its positions restart at 0 with the query after its last token, which moves every
    score of head h by the same ``slope_h * (last position - query position)``: cut where the
    kept positions jump, so each segment is contiguous, and add that to its LSE."""

    def __init__(self, trial: Trial, scheme: str):
        self.trial = trial
        self.logical, problem = trial.logical.per_token(), trial.problem
        self.kept = [problem.kept(r) for r in range(problem.tokens)]
        self.cuts = [_cuts(len(k), problem.page_size, scheme) for k in self.kept]
        if problem.alibi_slopes is not None:
            self.cuts = _at_gaps(self.cuts, self.kept)
        self.count = len(self.cuts[0]) - 1

    def job(self, j: int) -> Job:
        rows = [k[c[j]:c[j + 1]] for k, c in zip(self.kept, self.cuts, strict=True)]
        part = replace(self.logical.take(rows), window=None, sinks=0, sink_logits=None)
        return Job(part.lay_out(self.trial.problem.page_size,
                                seed(self.trial.case, "segment") + j))

    def shift(self, j: int, state: AttentionState) -> AttentionState:
        """The segment's LSE where its tokens really lie (ALiBi), else as it is."""
        problem = self.trial.problem
        if problem.alibi_slopes is None:
            return state
        offsets = np.array([k[c[j + 1] - 1] - p if c[j + 1] > c[j] else 0 for k, c, p
                            in zip(self.kept, self.cuts, problem.query_positions.tolist(),
                                   strict=True)])
        moved = state.lse + (offsets[:, None] * problem.alibi_slopes[None, :]).astype(
            np.float32)
        return AttentionState(state.out, np.where(np.isneginf(state.lse), state.lse, moved)
                              .astype(np.float32))


def segment_states(trial: Trial) -> dict[str, list[AttentionState] | str | Exception]:
    """Each scheme's decoded segments, or the error of the first that failed, or what the
    harness raised cutting them. The segments of all schemes are decoded one ahead
    (``Trial.decodes``): a segment after one that failed may be decoded, and not used."""
    found: dict[str, list[AttentionState] | str | Exception] = {}
    plans: dict[str, Segments] = {}
    for scheme in SCHEMES:
        try:
            plans[scheme] = Segments(trial, scheme)
        except Exception as exc:
            found[scheme] = exc
    order = [(scheme, j) for scheme, plan in plans.items() for j in range(plan.count)]

    def build(scheme: str, j: int) -> Callable[[], Job | None]:
        def built() -> Job | None:
            if scheme in found:  # an earlier segment failed: the scheme is judged already
                return None
            try:
                return plans[scheme].job(j)
            except Exception as exc:
                found[scheme] = exc
                return None
        return built

    states: dict[str, list[AttentionState]] = {scheme: [] for scheme in plans}
    for (scheme, j), item in zip(order, trial.decodes((build(*o), True) for o in order),
                                 strict=True):
        if item is None or scheme in found:
            continue
        _, run = item
        if run.exception:
            found[scheme] = f"segment {j} ({scheme} cuts): {run.exception}"
            continue
        try:
            states[scheme].append(plans[scheme].shift(j, run.state))
        except Exception as exc:
            found[scheme] = exc
    return {scheme: found.get(scheme, states.get(scheme)) for scheme in SCHEMES}


class Merged:
    """A merge a check asked for; ``state`` is its result once ``Merges.run`` has run (or
    raises its fault, or the fault of the merge it needed)."""

    def __init__(self, a: AttentionState | Merged, b: AttentionState | Merged):
        self.inputs = (a, b)
        self.result: AttentionState | Exception | None = None

    @property
    def state(self) -> AttentionState:
        if isinstance(self.result, Exception):
            raise self.result
        if self.result is None:
            raise RuntimeError("a merge read before Merges.run")
        return self.result


class Merges:
    """The merges of a check, asked first and sent to the backend a round at a time: each
    round is every merge whose inputs are known, in one request. The merge check needs three
    rounds a case where it made eighteen calls; those round trips were a tenth of a NumPy
    ``ci`` run (docs/isolation.md)."""

    def __init__(self, trial: Trial):
        self.trial = trial
        self.asked: list[Merged] = []

    def merge(self, a: AttentionState | Merged, b: AttentionState | Merged) -> Merged:
        self.asked.append(Merged(a, b))
        return self.asked[-1]

    def fold(self, states: list[AttentionState]) -> Merged | AttentionState:
        """Left to right, as a split-K kernel's combine walks its splits."""
        merged: Merged | AttentionState = states[0]
        for state in states[1:]:
            merged = self.merge(merged, state)
        return merged

    def run(self) -> None:
        while pending := [m for m in self.asked if m.result is None]:
            ready = []
            for merged in pending:
                needed = [x.result for x in merged.inputs if isinstance(x, Merged)]
                if any(r is None for r in needed):
                    continue
                # a merge whose input failed fails the same way, without a call
                merged.result = next((r for r in needed if isinstance(r, Exception)), None)
                if merged.result is None:
                    ready.append(merged)
            results = self.trial.merges([tuple(_state(x) for x in m.inputs) for m in ready]) \
                if ready else []
            for merged, result in zip(ready, results, strict=True):
                merged.result = result


def _state(item: AttentionState | Merged) -> AttentionState:
    return item.state if isinstance(item, Merged) else item


def check_merge(trial: Trial) -> list[Result]:
    """Split-K equivalence with the backend's merge, and the merge's algebra."""
    missing = {"lse", "merge"} - trial.has
    if missing:
        return [unsupported("merge", f"feature {', '.join(sorted(missing))} not in capabilities")]
    base = trial.first_run
    if base.exception:
        return [errored("merge", base)]
    plan = Merges(trial)
    judges: list[tuple[str, Callable[[], Result]]] = []
    pieces: dict[str, list[AttentionState]] = {}
    for scheme, states in segment_states(trial).items():
        check = f"merge/segments-{scheme}"
        if isinstance(states, Exception):
            judges.append((check, lambda check=check, exc=states: fault_outcome(check, exc)))
            continue
        if isinstance(states, str):
            judges.append((check, lambda check=check, states=states: Result.of(
                check, Status.ERROR, message=states)))
            continue
        pieces[scheme] = states
        judges.append((check, _segments(plan, trial, check, states)))
    empty = trial.empty_state()
    judges += [("merge/identity", _identity(plan, trial, base.state, empty)),
               ("merge/both-empty", _both_empty(plan, trial, empty))]
    if "page" in pieces:
        a, b, c, *_ = pieces["page"]  # three segments (four with ALiBi's gap cut)
        judges += [("merge/commutative", _commutative(plan, trial, a, b)),
                   ("merge/associative", _associative(plan, trial, a, b, c)),
                   ("merge/lse-gap", _lse_gap(plan, trial, a, b))]
    plan.run()
    return run_each(judges)


# Each sub-check below asks its merges of the plan now and returns its judgement, run once
# the plan has run.


def _segments(plan: Merges, trial: Trial, check: str, states: list[AttentionState]
              ) -> Callable[[], Result]:
    folded = plan.fold(states)
    ref_out, ref_lse = trial.reference
    return lambda: trial.compare(check, trial.with_sink(_state(folded)), ref_out, ref_lse,
                                 scale=len(states), what=f"{len(states)} segments merged vs oracle",
                                 out_floor=merge_rounding([s.lse for s in states], len(states) - 1))


def _as_pair(state: AttentionState) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(state.out, dtype=np.float64), state.lse


def _identity(plan: Merges, trial: Trial, state: AttentionState, empty: AttentionState
              ) -> Callable[[], Result]:
    asked = (("merge(x, empty)", plan.merge(state, empty)),
             ("merge(empty, x)", plan.merge(empty, state)))

    def judge() -> Result:
        for order, merged in asked:
            outcome = trial.compare("merge/identity", merged.state, *_as_pair(state), what=order)
            if outcome.status != Status.PASSED:
                return outcome
        return outcome
    return judge


def _both_empty(plan: Merges, trial: Trial, empty: AttentionState) -> Callable[[], Result]:
    asked = plan.merge(empty, replace(empty, out=empty.out.copy(), lse=empty.lse.copy()))

    def judge() -> Result:
        merged = asked.state
        out = np.asarray(merged.out, dtype=np.float64)
        error = lse_error(merged.lse, np.full(merged.lse.shape, -np.inf), trial.empty_lse)
        if np.isnan(out).any() or np.any(out != 0) or not math.isfinite(error):
            return Result.of("merge/both-empty", Status.FAILED, math.inf, message=(
                f"merge(empty, empty) gave {int(np.isnan(out).sum())} NaN and "
                f"{int(np.sum(np.nan_to_num(out) != 0))} non-zero output values, LSE "
                f"{float(merged.lse.flat[0])!r}; want 0 and {trial.empty_lse!r}"))
        return Result.of("merge/both-empty", Status.PASSED, 0.0)
    return judge


def _commutative(plan: Merges, trial: Trial, a: AttentionState, b: AttentionState
                 ) -> Callable[[], Result]:
    ba, ab = plan.merge(b, a), plan.merge(a, b)
    return lambda: trial.compare("merge/commutative", ba.state, *_as_pair(ab.state),
                                 what="merge(b, a) vs merge(a, b)")


def _associative(plan: Merges, trial: Trial, a: AttentionState, b: AttentionState,
                 c: AttentionState) -> Callable[[], Result]:
    tree, chain = plan.merge(a, plan.merge(b, c)), plan.merge(plan.merge(a, b), c)
    return lambda: trial.compare("merge/associative", tree.state, *_as_pair(chain.state),
                                 scale=2, what="tree vs left-to-right",
                                 out_floor=2 * merge_rounding([a.lse, b.lse, c.lse], 2))


def _lse_gap(plan: Merges, trial: Trial, a: AttentionState, b: AttentionState
             ) -> Callable[[], Result]:
    """States whose LSEs differ by more than 100, and states at |LSE| ~ 3e4."""
    live = np.isfinite(a.lse) & np.isfinite(b.lse) & (a.lse != trial.empty_lse) & \
        (b.lse != trial.empty_lse)
    asked = []
    for shift_a, shift_b in ((150.0, 0.0), (0.0, 150.0), (3e4, 3e4 - 120.0)):
        sa = AttentionState(out=a.out, lse=np.where(live, a.lse + np.float32(shift_a), a.lse)
                            .astype(np.float32))
        sb = AttentionState(out=b.out, lse=np.where(live, b.lse + np.float32(shift_b), b.lse)
                            .astype(np.float32))
        asked.append((shift_a, shift_b, sa, sb, plan.merge(sa, sb)))

    def judge() -> Result:
        worst: Result | None = None
        for shift_a, shift_b, sa, sb, merged in asked:
            ref_out, ref_lse = merge_reference(sa.out, np.where(live, sa.lse, -np.inf), sb.out,
                                               np.where(live, sb.lse, -np.inf))
            keep = np.where(live[..., None], merged.state.out, 0)
            want = np.where(live[..., None], ref_out, 0)
            outcome = trial.compare("merge/lse-gap", AttentionState(keep, np.where(
                live, merged.state.lse, trial.empty_lse).astype(np.float32)), want, ref_lse,
                what=f"LSE shifted by {shift_a:g} and {shift_b:g}")
            if worst is None or outcome.status != Status.PASSED:
                worst = outcome
            if outcome.status != Status.PASSED:
                break
        return worst
    return judge
