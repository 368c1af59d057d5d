"""The oracle as the checks call it: on a ``Problem``, in float64 or in a case's own
precision; and the parts of a large case's expected values computed side by side."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from conformance.polling import CPUS
from conformance.problem import Problem
from conformance.references import decode_reference

SIDE_BY_SIDE_BYTES = 1 << 30  # a case from this size (``Case.problem_bytes``) computes in threads


def reference_of(problem: Problem, precision: type = np.float64, lse_includes_sink: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
    return decode_reference(problem.q, problem.k_pages, problem.v_pages, problem.block_table,
                            problem.context_lens, sm_scale=problem.sm_scale,
                            window=problem.window, sinks=problem.sinks,
                            k_scale=problem.k_scale, v_scale=problem.v_scale,
                            q_scale=problem.q_scale, soft_cap=problem.soft_cap,
                            sink_logits=problem.sink_logits,
                            alibi_slopes=problem.alibi_slopes,
                            lse_includes_sink=lse_includes_sink, query_lens=problem.query_lens,
                            draft_mask=problem.draft_mask, precision=precision)


def reversed_dims(problem: Problem) -> Problem:
    """The same problem with head_dim reversed in q, K and V: the same answer (its output
    reversed), summed in another order."""
    return replace(problem, q=problem.q[..., ::-1], k_pages=problem.k_pages[..., ::-1],
                   v_pages=problem.v_pages[..., ::-1])


def side_by_side(problem_bytes: int, *work: Callable[[], Any]) -> list[Any]:
    """Each of ``work``'s results: for a case of ``SIDE_BY_SIDE_BYTES`` or more on threads of
    their own, else one after the other. Each part's arithmetic is the same either way (NumPy
    lets go of the GIL in its long loops; BLAS runs one thread a process), so are its results.

    The largest cases start first and end last in a parallel run (its critical path); their
    float64 oracle, the two precision oracles of the budget, its score errors and an fp8
    case's unquantized answer took 8.5 s one after another in the per-token fp8 16 x 8192
    case alone on an H100."""
    if problem_bytes < SIDE_BY_SIDE_BYTES or CPUS < 2 or len(work) < 2:
        return [part() for part in work]
    return [future.result() for future in [_executor().submit(part) for part in work]]


@functools.cache
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(4, thread_name_prefix="conformance-oracle")
