"""What a check returns (a ``Result`` the run has not placed yet), and the messages that
say where an answer went wrong."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from conformance.result import Result
from conformance.sandbox import ContractError, describe_exception
from conformance.status import Status
from conformance.tolerances import Budget


def locate(got: np.ndarray, want: np.ndarray) -> str:
    """Where the worst output element is, as ' at [row, head, dim]: got X, want Y' (row: the
    query row, the sequence's index in one-token decode)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.size == 0:
        return ""
    diff = np.where(np.isfinite(got), np.abs(got - want), np.inf)
    b, h, d = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return f" at [row {b}, head {h}, dim {d}]: got {got[b, h, d]:.6g}, want {want[b, h, d]:.6g}"


def cannot_judge_message(budget: Budget, admitted: dict[str, float]) -> str:
    answers = ", ".join(f"{name} (error {error:.3g})" for name, error in admitted.items())
    return (f"the output budget {budget.value:.3g} admits a trivially wrong answer on this "
            f"case: {answers}")


def fault_outcome(check: str, exc: Exception) -> Result:
    """A sub-check that raised: ``failed`` when the backend broke the contract, else ``error``."""
    status = Status.FAILED if isinstance(exc, ContractError) else Status.ERROR
    return Result.of(check, status, message=describe_exception(exc))


def unsupported(check: str, reason: str) -> Result:
    return Result.of(check, Status.UNSUPPORTED, message=reason)


def run_each(checks: list[tuple[str, Callable[[], Result]]]) -> list[Result]:
    """Run sub-checks; one that raises is an ``error`` outcome and the others still run."""
    outcomes = []
    for check, run_check in checks:
        try:
            outcomes.append(run_check())
        except Exception as exc:  # a backend fault is a result
            outcomes.append(fault_outcome(check, exc))
    return outcomes


def lse_message(got: np.ndarray, want: np.ndarray, error: float, budget: Budget,
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
    return (f"lse error {error:.3g} > budget {budget.value:.3g} at [row {b}, head {h}]: got "
            f"{got64[b, h]:.8g}, want {want64[b, h]:.8g}")

