"""Invariances (metamorphic checks): what must not change the answer.

With several query tokens per sequence each rule holds per query row (positions, masks and
scales travel with their tokens), and two more apply: every draft decoded alone, as one
token against what it sees, and the batch as two sub-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from conformance.backends.base import AttentionState
from conformance.checks.outcomes import run_each, unsupported
from conformance.checks.trial import (
    Outcome,
    Trial,
    errored,
    seed,
)
from conformance.materialise import LogicalKV, canonical_layout_seed
from conformance.problem import Problem
from conformance.references import kept_tokens
from conformance.spec import with_changes
from conformance.status import Status


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
    if problem.group_size > 1 and problem.kind == "gqa":  # an MLA latent is one head by design
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
    if problem.k_scale is not None:
        variants.append(("invariance/kv-scale", lambda: _rescaled(trial)))
    if problem.query_lens is not None:
        variants.append(("invariance/drafts-alone", lambda: _drafts_alone(trial)))
        if problem.batch > 1:
            variants.append(("invariance/sub-batches", lambda: _sub_batches(trial)))
    return run_each(variants)


def _same_answer(trial: Trial, check: str, problem: Problem, rows: list[int] | None = None,
                 num_splits: int | None = None, keep: list[int] | None = None,
                 out_factor: float = 1.0) -> Outcome:
    """Decode a re-laid problem and compare with the base run: the base's sequences
    ``rows`` (all by default) against the new problem's sequences ``keep`` (all by default),
    query row by query row, its output times ``out_factor`` (a transformation that scales
    the answer, undone)."""
    run = trial.decode(problem, num_splits=num_splits)
    if run.exception:
        return Outcome(check, Status.ERROR, message=run.exception)
    base = trial.first_run
    want_out, want_lse = base.out, base.lse
    if rows is not None:
        token_rows = trial.problem.rows_of(rows)
        want_out, want_lse = want_out[token_rows], want_lse[token_rows]
    got = AttentionState(np.asarray(run.out, np.float64) * out_factor if out_factor != 1.0
                         else run.out, run.lse)
    if keep is not None:
        token_rows = problem.rows_of(keep)
        got = AttentionState(got.out[token_rows], got.lse[token_rows])
    return trial.compare(check, got, np.asarray(want_out, np.float64), want_lse,
                         what=check.split("/", 1)[1])


def _neighbours(trial: Trial) -> Outcome:
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
    return _same_answer(trial, "invariance/neighbours", problem, keep=keep)


def _as_mha(trial: Trial) -> Outcome:
    """KV heads repeated so that every query head has its own: GQA as MHA."""
    case, logical, g = trial.case, trial.logical, trial.problem.group_size
    reason = trial.backend.unsupported_reason(with_changes(case, num_kv_heads=case.num_qo_heads))
    if reason:
        return unsupported("invariance/gqa-as-mha", reason)
    return _same_answer(trial, "invariance/gqa-as-mha", logical.repeat_heads(g).lay_out(
        case.page_size, seed(case, "gqa-as-mha"), case.table_padding))


def _rescaled(trial: Trial) -> Outcome:
    """The same fp8 codes read with K scales doubled and V scales halved, the query halved to
    match: the scores stay and the output halves, exactly. A kernel that holds the scales it
    saw first (or bakes them into a compiled kernel) answers the old problem."""
    case = trial.case
    # the canonical layout: the problem differs from the base run's in its scales alone
    problem = trial.logical.rescaled(2.0, 0.5).lay_out(
        case.page_size, canonical_layout_seed(case), case.table_padding, case.shared_pages)
    return _same_answer(trial, "invariance/kv-scale", problem, out_factor=2.0)


def _other_page_size(trial: Trial) -> Outcome:
    case = trial.case
    candidates = [case.page_size * 2, max(1, case.page_size // 2), 16, 1]
    for size in candidates:
        if size != case.page_size and not trial.backend.unsupported_reason(
                with_changes(case, page_size=size)):
            problem = trial.logical.lay_out(size, seed(case, "page-size"), case.table_padding)
            return _same_answer(trial, "invariance/page-size", problem)
    return unsupported("invariance/page-size", "no other page size in capabilities")


def _drafts_alone(trial: Trial) -> Outcome:
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
    return _same_answer(trial, check, single.lay_out(case.page_size, seed(case, "drafts-alone"),
                                                     case.table_padding))


def _sub_batches(trial: Trial) -> Outcome:
    """The batch as two sub-batches (its first half, then the rest), each decoded alone:
    ragged query lengths must not move one sequence's query rows into another's."""
    case, logical, half = trial.case, trial.logical, trial.problem.batch // 2
    outcome = None
    for part, rows in enumerate((list(range(half)), list(range(half, trial.problem.batch)))):
        outcome = _same_answer(trial, "invariance/sub-batches", logical.select(rows).lay_out(
            case.page_size, seed(case, "sub-batches") + part, case.table_padding), rows=rows)
        if outcome.status != Status.PASSED:
            return outcome
    return outcome
