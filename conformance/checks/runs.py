"""The families judged on the decode runs themselves: oracle, poison, purity, determinism."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from conformance.checks.outcomes import locate, unsupported
from conformance.checks.trial import (
    Trial,
    errored,
)
from conformance.dtypes import numpy_dtype
from conformance.problem import POISONS
from conformance.result import Result
from conformance.status import Status
from conformance.tolerances import ROUNDING_SAMPLE, ROUNDING_SHARE, Budget, output_error


def check_oracle(trial: Trial) -> list[Result]:
    """Output and LSE against the float64 oracle, within the dtype's budget."""
    run = trial.first_run
    if run.exception:
        return [errored("oracle/output", run), errored("oracle/lse", run)]
    ref_out, ref_lse = trial.reference
    outcomes = [_with_quantization(trial, trial.compare("oracle/output", run.state, ref_out,
                                                         None)),
                trial.compare("oracle/lse", run.state, None, ref_lse) if "lse" in trial.has
                else unsupported("oracle/lse", "feature lse not in capabilities")]
    rounding = _rounding(trial, run.out)
    return outcomes + ([rounding] if rounding else [])


def _with_quantization(trial: Trial, outcome: Result) -> Result:
    """An fp8 case's output verdict, with what the format itself costs beside it."""
    error = trial.quantization_error
    if error is None:
        return outcome
    note = (f"fp8 storage moves the float64 answer by {error:.3g} (output error against the "
            f"unquantized values; information, not part of the verdict)")
    return replace(outcome, message=f"{outcome.message}; {note}" if outcome.message else note)


def _rounding(trial: Trial, got: np.ndarray) -> Result | None:
    """A float16/bfloat16 output is its float32 result rounded to nearest even.

    A kernel that truncates (rounds toward zero) is never more than one ulp off, inside every
    budget. It shows where the oracle's value lies well past the midpoint between two
    neighbours in the output dtype (0.6 to 0.9 ulp above the lower in magnitude): rounding to
    nearest takes the upper, truncation the lower, every time; a kernel whose own error stays
    under 0.1 ulp (any float32-accumulating one) never misses there. Rounding away from zero
    shows the same way below the midpoint. A kernel with low-precision intermediates misses
    some there, both ways and in part: ``oracle/output`` judges its accuracy. Elements whose
    score errors alone may move them by a tenth of a spacing (``Trial.score_bound``) are left
    out; not emitted where too few elements lie in those bands to tell."""
    if trial.case.dtype not in ("float16", "bfloat16"):
        return None
    want = np.abs(trial.reference[0])
    got = np.asarray(got, dtype=np.float64)
    nearest = want.astype(numpy_dtype(trial.case.dtype))  # 16 bits: neighbours are bits +-1
    above = nearest.astype(np.float64) > want
    lower = np.where(above, _step(nearest, -1), nearest).astype(np.float64)
    upper = np.where(above, nearest, _step(nearest, 1)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        where = (want - lower) / (upper - lower)  # 0 at the lower neighbour, 1 at the upper
    # where the scores' own float32 rounding may move an element by a tenth of its spacing
    # (huge scores within their rounding of one another), a careful kernel may miss as well
    spacing = np.abs(upper - lower)
    settled = trial.score_bound[..., None] <= 0.1 * spacing
    finite = np.isfinite(got) & np.isfinite(where) & (want != 0) & settled
    outcomes = []
    for band, wrong, how in (((0.6, 0.9), lower, "toward zero"),
                             ((0.1, 0.4), upper, "away from zero")):
        inside = finite & (where >= band[0]) & (where <= band[1])
        count = int(inside.sum())
        if count < ROUNDING_SAMPLE:
            continue
        missed = int((np.abs(got[inside]) == wrong[inside]).sum())
        outcomes.append((missed / count, count, missed, how, band))
    if not outcomes:
        return None
    share, count, missed, how, band = max(outcomes)
    budget = Budget(ROUNDING_SHARE, math.nan)
    if share <= ROUNDING_SHARE:
        return Result.of("oracle/rounding", Status.PASSED, share, budget)
    return Result.of("oracle/rounding", Status.FAILED, share, budget,
                     f"rounded {how}, not to nearest even: of the {count} output elements whose "
                     f"oracle value lies {band[0]:g} to {band[1]:g} ulp past the {trial.case.dtype}"
                     f" value below it in magnitude, {missed} ({share:.0%}) hold the "
                     f"{'lower' if how == 'toward zero' else 'upper'} neighbour; rounding a "
                     f"float32 result to nearest gives none")


def _step(values: np.ndarray, direction: int) -> np.ndarray:
    """The next 16-bit float value above (+1) or below (-1) non-negative finite values."""
    bits = values.view(np.uint16).astype(np.int32) + direction
    return np.clip(bits, 0, 0x7BFF if values.dtype == np.float16 else 0x7F7F).astype(
        np.uint16).view(values.dtype)


def check_poison(trial: Trial) -> list[Result]:
    """Every output and LSE slot is written (two runs, two poisons), and NaN in the slots a
    kernel must not read never reaches an output."""
    return [_unwritten(trial), _masked_nan(trial)]


def _masked_nan(trial: Trial) -> Result:
    """The same problem with NaN, not garbage, where nothing may be read: reading masked slots
    and zeroing their weight passes ``oracle`` but turns this NaN into output."""
    check = "poison/masked-nan"
    run = trial.decode(trial.nan_masked, POISONS[1])
    trial.release("nan_masked")  # no other check reads it
    if run.exception:
        return errored(check, run)
    bad_out = np.isnan(np.asarray(run.out, dtype=np.float64)).any(axis=-1)
    bad = bad_out | np.isnan(run.lse)
    if not bad.any():
        return Result.of(check, Status.PASSED)
    b, h = (int(i) for i in np.argwhere(bad)[0])
    return Result.of(check, Status.FAILED, message=(
        f"NaN in the slots the kernel must not read reached {int(bad.sum())} (row, head) "
        f"rows of output or LSE (first at [row {b}, head {h}]); with finite values there "
        f"the kernel is judged by oracle, so it reads masked slots and weights them by zero"))


def _unwritten(trial: Trial) -> Result:
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
        return Result.of(check, Status.FAILED, message="; ".join(problems))
    return Result.of(check, Status.PASSED)


def check_purity(trial: Trial) -> list[Result]:
    """The inputs are bit-for-bit the same after the call."""
    for run in (trial.first_run, trial.second_run):
        if run.exception:
            return [errored("purity", run)]
        if run.mutated:
            return [Result.of("purity", Status.FAILED,
                              message=f"decode modified its inputs: {', '.join(run.mutated)}")]
    return [Result.of("purity", Status.PASSED)]


def check_determinism(trial: Trial) -> list[Result]:
    """The same call twice gives the same bits (or, if declared nondeterministic, close)."""
    a, b = trial.first_run, trial.second_run
    if a.exception or b.exception:
        return [errored("determinism", a if a.exception else b)]
    if not trial.backend.capabilities.deterministic:
        outcome = trial.compare("determinism", b.state, a.out, a.lse, what="second call")
        return [outcome]
    same = a.out.tobytes() == b.out.tobytes() and a.lse.tobytes() == b.lse.tobytes()
    if same:
        return [Result.of("determinism", Status.PASSED, 0.0)]
    error = output_error(b.out, a.out)
    return [Result.of("determinism", Status.FAILED, error,
                      message=f"two identical calls differ (output error {error:.3g})"
                              f"{locate(b.out, a.out)}")]
