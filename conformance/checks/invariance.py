"""Invariances (metamorphic checks): what must not change the answer.

With several query tokens per sequence each rule holds per query row (positions, masks and
scales travel with their tokens), and two more apply: every draft decoded alone, as one
token against what it sees, and the batch as two sub-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from conformance.backends.base import AttentionState
from conformance.checks.outcomes import fault_outcome, unsupported
from conformance.checks.trial import (
    Job,
    Run,
    Trial,
    errored,
    seed,
)
from conformance.materialise import LogicalKV, canonical_layout_seed
from conformance.references import kept_tokens
from conformance.result import Result
from conformance.spec import with_changes
from conformance.status import Status


@dataclass(frozen=True)
class Relaid(Job):
    """What one invariance decodes, and how its answer maps onto the base run's: the base's
    sequences ``rows`` (all by default) against this problem's ``keep`` (all by default), its
    output times ``out_factor`` (a transformation that scales the answer, undone)."""

    rows: list[int] | None = None
    keep: list[int] | None = None
    out_factor: float = 1.0


# (check, build, ahead): ``build`` makes the variant (or its outcome, when it cannot run);
# ``ahead``: it is NumPy work alone, made while the backend decodes the variant before it.
# A build that asks the backend anything waits for the variant before it (``Trial.decodes``).
Variant = tuple[str, Callable[[], "Relaid | Result"], bool]


def check_invariance(trial: Trial) -> list[Result]:
    """Metamorphic checks: what must not change the answer."""
    base = trial.first_run
    if base.exception:
        return [errored("invariance", base)]
    case, logical, problem = trial.case, trial.logical, trial.problem
    pad, shared = case.table_padding, case.shared_pages
    variants: list[Variant] = [
        ("invariance/reshuffle", lambda: Relaid(
            logical.lay_out(case.page_size, seed(case, "reshuffle"), pad, shared)), True),
        ("invariance/wide-table", lambda: Relaid(
            logical.lay_out(case.page_size, seed(case, "wide-table"), pad + 50, shared)), True),
        ("invariance/neighbours", lambda: _neighbours(trial), True),
    ]
    if problem.batch > 1:
        order = list(range(problem.batch))[::-1]
        variants.append(("invariance/batch-order", lambda: Relaid(
            logical.select(order).lay_out(case.page_size, seed(case, "batch-order"), pad),
            rows=order), True))
    if problem.group_size > 1 and problem.kind == "gqa":  # an MLA latent is one head by design
        variants.append(("invariance/gqa-as-mha", lambda: _as_mha(trial), False))
    if "split_k" in trial.has:
        for count in trial.backend.capabilities.split_counts:
            variants.append((f"invariance/split-count-{count}",
                             lambda count=count: Relaid(problem, num_splits=count), True))
    else:
        variants.append(("invariance/split-count",
                         lambda: unsupported("invariance/split-count",
                                             "feature split_k not in capabilities"), True))
    variants.append(("invariance/page-size", lambda: _other_page_size(trial), False))
    if problem.k_scale is not None:
        variants.append(("invariance/kv-scale", lambda: _rescaled(trial), True))
    if problem.query_lens is not None:
        variants.append(("invariance/drafts-alone", lambda: _drafts_alone(trial), True))
        if problem.batch > 1:
            variants.append(("invariance/sub-batches", lambda: _sub_batches(trial), False))
    return _run_variants(trial, variants)


def _run_variants(trial: Trial, variants: list[Variant]) -> list[Result]:
    """Each variant decoded and compared, in order, one ahead (``Trial.decodes``); one that
    raises is an ``error`` outcome and the others still run."""
    def build(check: str, make: Callable[[], Relaid | Result]) -> Callable[[], Relaid | Result]:
        def built() -> Relaid | Result:
            try:
                return make()
            except Exception as exc:  # a backend fault is a result
                return fault_outcome(check, exc)
        return built

    checks = iter(check for check, _, _ in variants)
    outcomes = []
    for item in trial.decodes((build(check, make), ahead) for check, make, ahead in variants):
        check = next(checks)
        if isinstance(item, Result):
            outcomes.append(item)
            continue
        try:
            outcomes.append(_same_answer(trial, check, *item))
        except Exception as exc:
            outcomes.append(fault_outcome(check, exc))
    return outcomes


def _same_answer(trial: Trial, check: str, variant: Relaid, run: Run) -> Result:
    """Compare a re-laid problem's run with the base run, query row by query row."""
    problem = variant.problem
    if run.exception:
        return Result.of(check, Status.ERROR, message=run.exception)
    base = trial.first_run
    want_out, want_lse = base.out, base.lse
    if variant.rows is not None:
        token_rows = trial.problem.rows_of(variant.rows)
        want_out, want_lse = want_out[token_rows], want_lse[token_rows]
    got = AttentionState(np.asarray(run.out, np.float64) * variant.out_factor
                         if variant.out_factor != 1.0 else run.out, run.lse)
    if variant.keep is not None:
        token_rows = problem.rows_of(variant.keep)
        got = AttentionState(got.out[token_rows], got.lse[token_rows])
    return trial.compare(check, got, np.asarray(want_out, np.float64), want_lse,
                         what=check.split("/", 1)[1])


def _neighbours(trial: Trial) -> Relaid:
    """Each sequence gets new neighbours (fresh sequences of other lengths between its rows)."""
    logical, case = trial.logical, trial.case
    rng = np.random.default_rng(seed(case, "neighbours"))
    parts, keep = [], []
    for b in range(len(logical.keys)):
        parts.append(logical.fresh(rng, int(rng.integers(0, 3 * case.page_size + 5))))
        keep.append(len(parts))
        parts.append(logical.select([b]))
    problem = LogicalKV.concat(parts).lay_out(case.page_size, seed(case, "neighbour-layout"),
                                              case.table_padding)
    return Relaid(problem, keep=keep)


def _as_mha(trial: Trial) -> Relaid | Result:
    """KV heads repeated so that every query head has its own: GQA as MHA."""
    case, logical, g = trial.case, trial.logical, trial.problem.group_size
    reason = trial.backend.unsupported_reason(with_changes(case, num_kv_heads=case.num_qo_heads))
    if reason:
        return unsupported("invariance/gqa-as-mha", reason)
    return Relaid(logical.repeat_heads(g).lay_out(case.page_size, seed(case, "gqa-as-mha"),
                                                  case.table_padding))


def _rescaled(trial: Trial) -> Relaid:
    """The same fp8 codes read with K scales doubled and V scales halved, the query halved to
    match: the scores stay and the output halves, exactly. A kernel that holds the scales it
    saw first (or bakes them into a compiled kernel) answers the old problem."""
    case = trial.case
    # the canonical layout: the problem differs from the base run's in its scales alone
    problem = trial.logical.rescaled(2.0, 0.5).lay_out(
        case.page_size, canonical_layout_seed(case), case.table_padding, case.shared_pages)
    return Relaid(problem, out_factor=2.0)


def _other_page_size(trial: Trial) -> Relaid | Result:
    case = trial.case
    candidates = [case.page_size * 2, max(1, case.page_size // 2), 16, 1]
    for size in candidates:
        if size != case.page_size and not trial.backend.unsupported_reason(
                with_changes(case, page_size=size)):
            return Relaid(trial.logical.lay_out(size, seed(case, "page-size"),
                                                case.table_padding))
    return unsupported("invariance/page-size", "no other page size in capabilities")


def _drafts_alone(trial: Trial) -> Relaid | Result:
    """Each query token decoded alone, as one token per sequence against the tokens it
    sees, through the same backend: a multi-token decode is its drafts' one-token decodes.
    Where every row sees a prefix of its sequence (causal, a chain, a tree's first branch)
    that prefix is the context, window, sinks and ALiBi as they are; otherwise the row's
    visible tokens alone, without window or sinks (ALiBi then has no positions to keep)."""
    check, problem, case = "invariance/drafts-alone", trial.problem, trial.case
    positions = problem.query_positions.tolist()
    prefixes = all(np.array_equal(problem.kept(r), kept_tokens(p + 1, problem.window,
                                                               problem.sinks))
                   for r, p in enumerate(positions))
    if prefixes:
        single = trial.logical.per_token([p + 1 for p in positions])
    elif problem.alibi_slopes is not None:
        return unsupported(check, "a draft that sees a non-contiguous set of tokens (a tree "
                                  "branch) has no one-token decode that keeps its ALiBi "
                                  "positions")
    else:
        single = replace(trial.logical.per_token().take(
            [problem.kept(r) for r in range(problem.tokens)]), window=None, sinks=0)
    return Relaid(single.lay_out(case.page_size, seed(case, "drafts-alone"),
                                 case.table_padding))


def _sub_batches(trial: Trial) -> Result:
    """The batch as two sub-batches (its first half, then the rest), each decoded alone:
    ragged query lengths must not move one sequence's query rows into another's."""
    case, logical, half = trial.case, trial.logical, trial.problem.batch // 2
    outcome = None
    for part, rows in enumerate((list(range(half)), list(range(half, trial.problem.batch)))):
        half_problem = logical.select(rows).lay_out(case.page_size, seed(case, "sub-batches")
                                                    + part, case.table_padding)
        outcome = _same_answer(trial, "invariance/sub-batches", Relaid(half_problem, rows=rows),
                               trial.decode(half_problem))
        if outcome.status != Status.PASSED:
            return outcome
    return outcome
