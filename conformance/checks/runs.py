"""The families judged on the decode runs themselves: oracle, poison, purity, determinism."""

from __future__ import annotations

import math

import numpy as np

from conformance.checks.trial import (
    Outcome,
    Trial,
    errored,
    locate,
    unsupported,
)
from conformance.problem import POISONS, materialise
from conformance.status import Status
from conformance.tolerances import output_error


def check_oracle(trial: Trial) -> list[Outcome]:
    """Output and LSE against the float64 oracle, within the dtype's budget."""
    run = trial.first_run
    if run.exception:
        return [errored("oracle/output", run), errored("oracle/lse", run)]
    ref_out, ref_lse = trial.reference
    if "lse" not in trial.has:
        return [trial.compare("oracle/output", run.state, ref_out, None),
                unsupported("oracle/lse", "feature lse not in capabilities")]
    return [trial.compare("oracle/output", run.state, ref_out, None),
            trial.compare("oracle/lse", run.state, None, ref_lse)]



def check_poison(trial: Trial) -> list[Outcome]:
    """Every output and LSE slot is written (two runs, two poisons), and NaN in the slots a
    kernel must not read never reaches an output."""
    return [_unwritten(trial), _masked_nan(trial)]


def _masked_nan(trial: Trial) -> Outcome:
    """The same problem with NaN, not garbage, where nothing may be read: reading masked slots
    and zeroing their weight passes ``oracle`` but turns this NaN into output."""
    check = "poison/masked-nan"
    problem = materialise(trial.case, masked="nan")
    run = trial.decode(problem, POISONS[1])
    if run.exception:
        return errored(check, run)
    bad_out = np.isnan(np.asarray(run.out, dtype=np.float64)).any(axis=-1)
    bad = bad_out | np.isnan(run.lse)
    if not bad.any():
        return Outcome(check, Status.PASSED)
    b, h = (int(i) for i in np.argwhere(bad)[0])
    return Outcome(check, Status.FAILED, message=(
        f"NaN in the slots the kernel must not read reached {int(bad.sum())} (batch, head) "
        f"rows of output or LSE (first at [batch {b}, head {h}]); with finite values there "
        f"the kernel is judged by oracle, so it reads masked slots and weights them by zero"))


def _unwritten(trial: Trial) -> Outcome:
    check = "poison/unwritten"
    problems = []
    for run, poison in ((trial.first_run, POISONS[0]), (trial.second_run, POISONS[1])):
        if run.exception:
            return errored(check, run)
        for name, array in (("output", run.out), ("lse", run.lse)):
            values = np.asarray(array, dtype=np.float64)
            stale = np.isnan(values) if math.isnan(poison) else values == poison
            if stale.any():
                where = np.argwhere(stale)[0].tolist()
                problems.append(f"{int(stale.sum())} {name} slots still hold poison {poison} "
                                f"(first at index {where})")
    if problems:
        return Outcome(check, Status.FAILED, message="; ".join(problems))
    return Outcome(check, Status.PASSED)


def check_purity(trial: Trial) -> list[Outcome]:
    """The inputs are bit-for-bit the same after the call."""
    for run in (trial.first_run, trial.second_run):
        if run.exception:
            return [errored("purity", run)]
        if run.mutated:
            return [Outcome("purity", Status.FAILED,
                            message=f"decode modified its inputs: {', '.join(run.mutated)}")]
    return [Outcome("purity", Status.PASSED)]


def check_determinism(trial: Trial) -> list[Outcome]:
    """The same call twice gives the same bits (or, if declared nondeterministic, close)."""
    a, b = trial.first_run, trial.second_run
    if a.exception or b.exception:
        return [errored("determinism", a if a.exception else b)]
    if not trial.backend.capabilities.deterministic:
        outcome = trial.compare("determinism", b.state, a.out, a.lse, what="second call")
        return [outcome]
    same = a.out.tobytes() == b.out.tobytes() and a.lse.tobytes() == b.lse.tobytes()
    if same:
        return [Outcome("determinism", Status.PASSED, 0.0)]
    error = output_error(b.out, a.out)
    return [Outcome("determinism", Status.FAILED, error,
                    message=f"two identical calls differ (output error {error:.3g})"
                            f"{locate(b.out, a.out)}")]
