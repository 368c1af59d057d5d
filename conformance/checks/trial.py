"""What the checks of one (backend, case) share: the ``Trial`` and its outcomes.

A ``Trial`` holds the problem, the float64 oracle, the budget and the two poisoned decode
runs, each computed once; each family (the sibling modules) is a function of a trial that
returns ``Result`` records named ``family/sub-check``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from conformance.backends.base import AttentionState
from conformance.checks.oracle import reference_of, reversed_dims, side_by_side
from conformance.checks.outcomes import cannot_judge_message, locate, lse_message
from conformance.checks.shared import SHARED
from conformance.dtypes import numpy_dtype
from conformance.materialise import LogicalKV, drawn_kv, logical_kv, materialise
from conformance.problem import POISONS, Problem, poisoned_outputs
from conformance.references import apply_sink
from conformance.references.decode import Modifiers, gather_sequence
from conformance.result import Result
from conformance.sandbox import BackendHandle, describe_exception
from conformance.spec import Case
from conformance.status import Status
from conformance.tolerances import (
    RATIO,
    Budget,
    admitted_answers,
    head_dots,
    lse_error,
    lse_errors,
    lse_rounding,
    output_error,
    output_errors,
    output_rounding,
    score_error_bound,
    score_errors,
    score_rounding,
    table_budget,
    trivial_answers,
    wrong_rows_heads,
)


@dataclass(frozen=True)
class Job:
    """A decode a check asks for: its problem and its split count (the case's by default)."""

    problem: Problem
    num_splits: int | None = None


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

    The backend is reached only through its handle, which hands it copies: the problem and
    the oracle here are never seen by the code under test."""

    def __init__(self, backend: BackendHandle, case: Case):
        self.backend = backend
        self.case = case

    def shared(self, key: tuple, compute: Callable[[], Any]) -> Any:
        return SHARED.get(self.case, key, compute)

    @property
    def declared(self) -> tuple[str, bool]:
        """What a budget depends on beyond the case: the backend's float32 matmul precision
        and whether its LSE counts sink logits."""
        return self.backend.capabilities.float32_matmul, self.lse_includes_sink

    @cached_property
    def logical(self) -> LogicalKV:
        if self.case.kv_dtype or self.case.q_dtype:  # its floats serve the quantization error
            return self.shared(("logical",), lambda: logical_kv(self.case, drawn=self.drawn))
        return self.shared(("logical",), lambda: logical_kv(self.case))

    @cached_property
    def drawn(self) -> tuple[LogicalKV, np.random.Generator]:
        """A quantized case's values before they are stored, drawn once."""
        return self.shared(("drawn",), lambda: drawn_kv(self.case))

    @cached_property
    def problem(self) -> Problem:
        return self.shared(("problem",), lambda: materialise(self.case, logical=self.logical))

    @cached_property
    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        return self.shared(("reference", self.lse_includes_sink), lambda: reference_of(
            self.problem, lse_includes_sink=self.lse_includes_sink))

    @property
    def lse_includes_sink(self) -> bool:
        return self.backend.conventions.lse_includes_sink

    @cached_property
    def budget(self) -> tuple[Budget, Budget]:
        """(output budget, LSE budget) for this case on this backend."""
        return self.shared(("budget", *self.declared), self._budget)

    def _budget(self) -> tuple[Budget, Budget]:
        table = table_budget(self.case.dtype, self.backend.capabilities.float32_matmul)
        dtype = numpy_dtype(self.case.dtype)
        # a second oracle in the case's precision sums in another order: the ratio rule must
        # not rest on one lucky summation order (found by explore at scores of ~-1e5); the
        # float64 oracle (on the way to the score bound) and an fp8 case's unquantized answer
        # are computed beside them, by threads of their own in a large case
        (low_out, low_lse), (reordered_out, _), *_ = side_by_side(
            self.case.problem_bytes,
            lambda: reference_of(self.problem, dtype, self.lse_includes_sink),
            lambda: reference_of(reversed_dims(self.problem), dtype),
            lambda: self.score_bound, lambda: self.unquantized_reference)
        ref_out, ref_lse = self.reference
        ratio_out = RATIO * max(output_error(low_out, ref_out),
                                output_error(reordered_out[..., ::-1], ref_out))
        ratio_out = max(ratio_out if math.isfinite(ratio_out) else 0.0,  # inf: it overflowed
                        output_rounding(self.score_bound, ref_out, numpy_dtype(self.case.dtype)))
        ratio_lse = RATIO * lse_error(low_lse, ref_lse)  # inf where that oracle overflowed
        ratio_lse = max(ratio_lse if math.isfinite(ratio_lse) else 0.0,
                        lse_rounding(score_rounding(self.score_errors, self.problem.num_qo_heads),
                                     ref_lse))
        return Budget(table, ratio_out), Budget(table, ratio_lse)

    @cached_property
    def kept_scores(self) -> list[np.ndarray]:
        return self.shared(("kept_scores",), self._kept_scores)

    def _kept_scores(self) -> list[np.ndarray]:
        """Per query row, ``(num_qo_heads, n)`` float64: the scores the softmax sees
        (scaled, capped, biased), of the kept tokens."""
        keys, _ = self.kept_kv
        problem = self.problem
        modifiers = Modifiers(np.float64, problem.sm_scale, problem.soft_cap, None,
                              problem.alibi_slopes)
        scores = []
        positions = problem.query_positions
        for r, k in enumerate(keys):
            offsets = problem.kept(r) - positions[r]
            raw = head_dots(self.query64[r], k)
            scores.append(np.stack([modifiers.scores(raw[h], h, offsets)
                                    for h in range(raw.shape[0])]) if raw.size else raw)
        return scores

    @cached_property
    def score_errors(self) -> list[np.ndarray]:
        """Per row, how far float32 arithmetic alone may move each score."""
        return self.shared(("score_errors",), self._score_errors)

    def _score_errors(self) -> list[np.ndarray]:
        keys, _ = self.kept_kv
        return score_errors(self.query64, keys, self.problem.sm_scale, self.kept_scores,
                            self.problem.soft_cap)

    @cached_property
    def score_bound(self) -> np.ndarray:
        """``(batch, heads)``: how far those score errors alone may move each row's output."""
        return self.shared(("score_bound", self.lse_includes_sink), self._score_bound)

    def _score_bound(self) -> np.ndarray:
        _, values = self.kept_kv
        return score_error_bound(self.score_errors, self.kept_scores, values,
                                 self.reference[0], self.problem.sink_logits)

    @property
    def query64(self) -> np.ndarray:
        """The query as the values it denotes, float64 (an fp8 query's codes times scale)."""
        q = self.problem.q.astype(np.float64)
        return q if self.problem.q_scale is None else q * float(self.problem.q_scale[0])

    @cached_property
    def trivial(self) -> dict[str, np.ndarray]:
        """Trivially wrong answers to this case (``trivial_answers``)."""
        return self.shared(("trivial", self.lse_includes_sink), self._trivial)

    def _trivial(self) -> dict[str, np.ndarray]:
        _, values = self.kept_kv
        return trivial_answers(self.kept_scores, values, self.reference[0],
                               self.problem.sink_logits)

    @cached_property
    def kept_kv(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per query row, the kept keys and values in float64, ``(n, num_kv_heads, d)``
        each (the values a quantized cache's codes denote); query head h reads KV head
        ``h // group_size``. Held by the trial too: a case too large for ``SHARED`` would
        otherwise gather them for each of the four values made from them."""
        return self.shared(("kept_kv",), self._kept_kv)

    def _kept_kv(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        problem = self.problem
        keys, values = [], []
        for r, b in enumerate(problem.row_sequence):
            k, v = gather_sequence(problem.k_pages, problem.v_pages, problem.block_table[b],
                                   problem.kept(r), problem.k_scale, problem.v_scale)
            keys.append(k.astype(np.float64, copy=False))
            values.append(v.astype(np.float64, copy=False))
        return keys, values

    @cached_property
    def quantization_error(self) -> float | None:
        """How far storing this case in fp8 moves the float64 answer (output error of the
        oracle on the codes against the oracle on the values before quantizing): what the
        format costs, reported beside the verdict and never part of it."""
        exact = self.unquantized_reference
        return None if exact is None else output_error(self.reference[0], exact)

    @cached_property
    def unquantized_reference(self) -> np.ndarray | None:
        """A quantized case's float64 output on its values before they were stored."""
        return self.shared(("unquantized",), self._unquantized_reference)

    def _unquantized_reference(self) -> np.ndarray | None:
        if self.problem.k_scale is None and self.problem.q_scale is None:
            return None
        return reference_of(materialise(self.case, logical=logical_kv(
            self.case, quantized=False, drawn=self.drawn)))[0]

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
        finish = self.start(problem, poison, num_splits)
        if meanwhile is not None:
            meanwhile()
        return finish()

    def start(self, problem: Problem, poison: float = POISONS[0], num_splits: int | None = None
              ) -> Callable[[], Run]:
        """Send one poisoned decode call; the returned function waits for its ``Run``."""
        out, lse = poisoned_outputs(problem, poison)
        try:
            result = self.backend.submit_decode(
                problem, out, lse, num_splits if num_splits else self.case.num_splits)
        except Exception as exc:  # a backend fault is a result, not a crash of the run
            refused = Run(exception=describe_exception(exc))
            return lambda: refused

        def finish() -> Run:
            try:
                got, got_lse, mutated = result()
            except Exception as exc:
                return Run(exception=describe_exception(exc))
            return Run(out=got, lse=got_lse, mutated=mutated)
        return finish

    def decodes(self, builds: Iterable[tuple[Callable[[], Job | Any], bool]]
                ) -> Iterator[tuple[Job, Run] | Any]:
        """Decode a check's jobs in order, one ahead: job i+1 is built (NumPy work, ``ahead``)
        and sent while the backend decodes job i, whose run is judged while the backend
        decodes job i+1, so that harness and worker work at once. Yields ``(job, run)``, or
        what a build made that is not a ``Job`` (an outcome without a decode), in order.

        A build that asks the backend anything (``ahead`` False) waits until the job before
        it is back: a fault of its own must not cost that job's verdict."""
        sent: tuple[Job, Callable[[], Run]] | None = None  # out, its run not yet read
        try:
            for build, ahead in builds:
                if not ahead and sent is not None:
                    done, sent = sent, None
                    yield done[0], done[1]()
                made = build()
                done, sent = sent, ((made, self.start(made.problem, num_splits=made.num_splits))
                                    if isinstance(made, Job) else None)
                if done is not None:
                    yield done[0], done[1]()
                if sent is None:
                    yield made
            if sent is not None:
                done, sent = sent, None
                yield done[0], done[1]()
        finally:
            if sent is not None:  # the consumer stopped early: read the reply still out
                sent[1]()

    @cached_property
    def first_run(self) -> Run:
        # the backend gets its own copy of the problem; the oracle works on this one meanwhile
        return self.decode(self.problem, POISONS[0], meanwhile=lambda: self.budget)

    @cached_property
    def second_run(self) -> Run:
        # poison's next call is on the masked-NaN problem: it is laid out meanwhile
        return self.decode(self.problem, POISONS[1], meanwhile=lambda: self.nan_masked)

    @cached_property
    def nan_masked(self) -> Problem:
        """The canonical problem with NaN, not garbage, in every slot nothing may read."""
        return materialise(self.case, masked="nan", logical=self.logical)

    def release(self, name: str) -> None:
        """Forget a cached value its last check has used: a problem's pools are then memory
        the case's later layouts reuse (``bulk.recycling``) instead of fresh pages."""
        self.__dict__.pop(name, None)

    def merges(self, pairs: list[tuple[AttentionState, AttentionState]]
               ) -> list[AttentionState | Exception]:
        """The backend's merges of independent pairs, in one request: each the merged state
        or its fault (``ContractError`` for a result outside the contract)."""
        return self.backend.merges(pairs)

    def with_sink(self, state: AttentionState) -> AttentionState:
        """A state over all of a row's tokens with the case's sink logits joined once
        (``apply_sink``), its LSE as the backend's convention has it."""
        sink = self.problem.sink_logits
        if sink is None:
            return state
        out, lse = apply_sink(state.out, state.lse, sink)
        return AttentionState(out, lse.astype(np.float32) if self.lse_includes_sink
                              else state.lse)

    def empty_state(self) -> AttentionState:
        rows, heads = self.problem.q.shape[:2]
        return AttentionState(out=np.zeros((rows, heads, self.problem.head_dim_v),
                                           dtype=self.problem.dtype),
                              lse=np.full((rows, heads), self.empty_lse, dtype=np.float32))

    def compare(self, check: str, got: AttentionState, want_out: np.ndarray | None,
                want_lse: np.ndarray | None, scale: float = 1.0, what: str = "",
                out_floor: float = 0.0) -> Result:
        """Result of comparing a state with a wanted one: its output and (if wanted and the
        backend writes one) its LSE, judged by whichever is further past its budget (the
        output's at least ``out_floor``: rounding the check itself brings, as a merge's).

        Against the oracle's output, a pass within a budget that admits a trivially wrong
        answer is ``cannot-judge``, not ``passed``."""
        out_budget, lse_budget = (b.scaled(scale) for b in self.budget)
        if out_floor > out_budget.value:
            out_budget = Budget(out_floor, out_budget.ratio)
        parts = []  # (error / budget, error, budget, errors, message if it fails)
        suffix = f" ({what})" if what else ""
        if want_out is not None:
            errors = output_errors(got.out, want_out)
            error = float(errors.max(initial=0.0))
            parts.append((error / out_budget.value, error, out_budget, errors, lambda e=error:
                          f"output error {e:.3g} > budget {out_budget.value:.3g}{suffix}"
                          f"{locate(got.out, want_out)}"))
        if want_lse is not None and "lse" in self.has:
            errors = lse_errors(got.lse, want_lse, self.empty_lse)
            error = float(errors.max(initial=0.0))
            parts.append((error / lse_budget.value, error, lse_budget, errors, lambda e=error:
                          lse_message(got.lse, want_lse, e, lse_budget, self.empty_lse)
                          + suffix))
        _, error, budget, errors, message = max(parts, key=lambda part: part[0])
        if error > budget.value:
            rows, heads = wrong_rows_heads(errors, budget.value)
            return Result.of(check, Status.FAILED, error, budget,
                             f"{message()}; wrong in rows {rows}, heads {heads}", heads)
        if want_out is self.reference[0]:
            admitted = admitted_answers(out_budget.value, out_budget.table, self.trivial,
                                        want_out)
            if admitted:
                return Result.of(check, Status.CANNOT_JUDGE, error, budget, cannot_judge_message(
                    out_budget, admitted) + suffix)
        return Result.of(check, Status.PASSED, error, budget)


def errored(check: str, run: Run) -> Result | None:
    return Result.of(check, Status.ERROR, message=run.exception) if run.exception else None


# Offsets from a case's seed for the layouts the checks make, so no two draw the same pages.
SEEDS = {"wide-table": 1, "reshuffle": 2, "batch-order": 3, "neighbours": 4,
         "neighbour-layout": 5, "gqa-as-mha": 6, "page-size": 7, "drafts-alone": 8,
         "segment": 10, "sub-batches": 30}


def seed(case: Case, use: str) -> int:
    return case.seed + SEEDS[use]


