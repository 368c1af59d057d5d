"""Invariances (metamorphic checks): what must not change the answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from backends.base import AttentionState
from conformance.checks.trial import (
    Outcome,
    Trial,
    errored,
    run_each,
    seed,
    unsupported,
)
from conformance.problem import Problem
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


def _same_answer(trial: Trial, check: str, problem: Problem, rows: list[int] | None = None,
                 num_splits: int | None = None, keep: list[int] | None = None) -> Outcome:
    """Decode a re-laid problem and compare with the base run: base rows ``rows`` (all by
    default) against the new problem's rows ``keep`` (all by default)."""
    run = trial.decode(problem, num_splits=num_splits)
    if run.exception:
        return Outcome(check, Status.ERROR, message=run.exception)
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
    mixed = replace(logical, q=np.stack(q), keys=tuple(keys), values=tuple(values))
    problem = mixed.lay_out(case.page_size, seed(case, "neighbour-layout"),
                             case.table_padding)
    return _same_answer(trial, "invariance/neighbours", problem, keep=keep)


def _as_mha(trial: Trial) -> Outcome:
    """KV heads repeated so that every query head has its own: GQA as MHA."""
    case, logical, g = trial.case, trial.logical, trial.problem.group_size
    reason = trial.backend.unsupported_reason(with_changes(case, num_kv_heads=case.num_qo_heads))
    if reason:
        return unsupported("invariance/gqa-as-mha", reason)
    mha = replace(logical, keys=tuple(np.repeat(k, g, axis=1) for k in logical.keys),
                  values=tuple(np.repeat(v, g, axis=1) for v in logical.values))
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
