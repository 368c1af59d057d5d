"""Budgets that can tell a right answer from a trivially wrong one (issue 17, point 5)."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pytest

from conformance.backends.base import Conventions
from conformance.checks.trial import Trial
from conformance.runner import evaluate
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec
from conformance.status import Status
from conformance.tolerances import Budget, admitted_answers, output_error, wrong_rows_heads

CI_CASES = select_cases(default_spec(), "ci")


class _Ieee:
    float32_matmul = "ieee"
    features = frozenset()


class _NoBackend:
    """Enough of a handle for the budget, which never calls the backend."""

    capabilities = _Ieee()
    conventions = Conventions()


def test_no_ci_budget_admits_a_trivially_wrong_answer():
    """The low-precision model once rounded scores to the dtype: at scores of -1e5 its own
    bfloat16 answer was noise and the budget (4.0) admitted zeros."""
    blind = {}
    for case in CI_CASES:
        trial = Trial(_NoBackend(), case)
        out_budget, _ = trial.budget
        admitted = admitted_answers(out_budget.value, out_budget.table, trial.trivial,
                                    trial.reference[0])
        if admitted:
            blind[case.id] = (out_budget.value, admitted)
    assert not blind, blind


def test_the_trivial_answers_are_wrong_where_attention_is_not_trivial():
    case = next(c for c in CI_CASES if c.id.startswith("basic/") and c.dtype == "float32")
    trial = Trial(_NoBackend(), case)
    errors = {name: output_error(answer, trial.reference[0])
              for name, answer in trial.trivial.items()}
    assert set(errors) == {"zeros", "mean of V", "one token dropped"}
    assert all(error > 1e-2 for error in errors.values()), errors


class WidenedBudget(Trial):
    """A trial whose ratio rule widens the output budget to 10, as the old low-precision
    model did to 4.0: wide enough for zeros."""

    @cached_property
    def budget(self):
        out_budget, lse_budget = Trial.budget.func(self)
        return Budget(out_budget.table, 10.0), lse_budget


@pytest.mark.parametrize("backend", ["numpy", "tests.planted:ScoresHeldInDtype"])
def test_a_pass_within_a_budget_that_admits_zeros_is_cannot_judge(backend):
    case = next(c for c in CI_CASES if "very-negative" in c.id and c.dtype == "bfloat16")
    run = open_backend(backend, isolated=False)
    settings = RunSettings(profile="ci", isolated=False)
    trial = WidenedBudget(run.connect(False), case)
    results = {r.check: r for r in evaluate(run, case, "oracle", settings, trial)}
    output = results["oracle/output"]
    assert output.status == Status.CANNOT_JUDGE, output
    assert "zeros" in output.message and "admits" in output.message
    # the same backend at the real budget: judged (numpy passes, the planted bug fails)
    judged = {r.check: r for r in evaluate(run, case, "oracle", settings)}["oracle/output"]
    want = Status.PASSED if backend == "numpy" else Status.FAILED
    assert judged.status == want, judged


def test_the_low_precision_model_holds_scores_in_float32():
    """At scores near -1e5 the model's bfloat16 answer stays close to the float64 one."""
    case = next(c for c in CI_CASES if "very-negative" in c.id and c.dtype == "bfloat16")
    trial = Trial(_NoBackend(), case)
    out_budget, _ = trial.budget
    assert out_budget.ratio < 0.1, out_budget
    assert np.isfinite(out_budget.value)


def test_wrong_rows_heads_names_the_rows_and_heads_past_the_budget():
    errors = np.zeros((3, 8, 4))
    errors[1, [1, 3], 2] = 1.0
    assert wrong_rows_heads(errors, 0.5) == ("[1] of 3", "[1, 3] of 8")
    errors[:, :, 0] = np.inf
    assert wrong_rows_heads(errors, 0.5) == ("all 3", "all 8")
    assert wrong_rows_heads(np.zeros((2, 4)), 0.5) == ("", "")
