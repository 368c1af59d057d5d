"""The checks (docs/design.md §6): functions of a ``Trial``, knowing nothing of any backend.

``trial`` holds what the checks of one (backend, case) share; ``runs``, ``merge`` and
``invariance`` hold the families. A sub-check that does not apply to the case (batch order
for a batch of one) is simply not emitted.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.checks.invariance import check_invariance
from conformance.checks.merge import check_merge
from conformance.checks.oracle import reference_of
from conformance.checks.runs import check_determinism, check_oracle, check_poison, check_purity
from conformance.checks.trial import Run, Trial
from conformance.result import Result
from conformance.sandbox import describe_exception

CHECK_FAMILIES: dict[str, Callable[[Trial], list[Result]]] = {
    "oracle": check_oracle,
    "poison": check_poison,
    "purity": check_purity,
    "determinism": check_determinism,
    "merge": check_merge,
    "invariance": check_invariance,
}

__all__ = ["CHECK_FAMILIES", "Run", "Trial", "describe_exception", "reference_of"]
