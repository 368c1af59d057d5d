"""The one record of a verdict: a check makes it, the run places it, every report reads it.

A check knows what it measured (its name, status, error, budget, message) but not which
backend or case it ran for; the run fills those in with ``placed``, after the expectation
manifest has had its say. Standard library only: reports read results on machines that
have none of the backends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Result:
    """One sub-check (``family/name``) of one case on one backend."""

    check: str
    status: str
    error: float | None = None
    budget: float | None = None  # what the error was held to: the larger of the two below
    budget_table: float | None = None  # the dtype's table budget
    budget_ratio: float | None = None  # a multiple of the low-precision oracle's own error
    message: str = ""
    backend: str = ""
    case: str = ""
    reproducer: str = ""
    dtype: str = ""  # the case's, so that reports never parse ids
    context: int = 0  # the case's longest context
    wrong_heads: str = ""  # the query heads past the budget ("[1, 3] of 8"): failures group by it

    # the order of a report's keys (schemas/report.schema.json)
    KEYS = ("backend", "case", "check", "status", "error", "budget", "budget_table",
            "budget_ratio", "message", "reproducer", "dtype", "context", "wrong_heads")

    @classmethod
    def of(cls, check: str, status: str, error: float | None = None, budget: Any = None,
           message: str = "", wrong_heads: str = "") -> Result:
        """What a check returns; ``budget`` a ``tolerances.Budget`` (value, table, ratio)."""
        if budget is None:
            return cls(check, status, error, message=message, wrong_heads=wrong_heads)
        return cls(check, status, error, budget.value, budget.table, budget.ratio, message,
                   wrong_heads=wrong_heads)

    def placed(self, backend: str, case: str, status: str, note: str, reproducer: str,
               dtype: str, context: int) -> Result:
        """This result as reported: where it ran, the manifest's status and note, its rerun."""
        message = "; ".join(part for part in (self.message, note) if part)
        return replace(self, backend=backend, case=case, status=status, message=message,
                       reproducer=reproducer, dtype=dtype, context=context)

    @property
    def family(self) -> str:
        return self.check.split("/", 1)[0]

    def as_dict(self) -> dict:
        return {**{key: getattr(self, key) for key in self.KEYS}, "family": self.family}
