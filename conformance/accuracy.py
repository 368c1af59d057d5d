"""Accuracy baselines: per-check errors saved from one run, compared in a later one.

A check whose error grew by more than a factor fails as ``drift/<check>`` even while it is
still inside its budget: a kernel change that makes accumulation worse shows up before it
becomes a tolerance failure. Errors below 1% of the budget count as that 1%, so noise at the
level of rounding does not flag.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from conformance import machine
from conformance.inputs import read_saved, write_atomically
from conformance.result import Result
from conformance.status import Status
from conformance.verdict import RunReport

SCHEMA = "paged-decode-conformance/accuracy/1"
NOISE_FLOOR = 0.01  # of the budget


def accuracy_dict(report: RunReport) -> dict:
    errors: dict[str, dict[str, dict[str, float]]] = {}
    for result in report.results:
        if result.error is not None and math.isfinite(result.error) and result.status in (
                Status.PASSED, Status.KNOWN_FAILURE):
            errors.setdefault(result.backend, {}).setdefault(result.case, {})[result.check] = \
                result.error
    return {"schema": SCHEMA, "profile": report.settings.profile, "machine": machine.describe(),
            "errors": errors}


def save_accuracy(report: RunReport, path: Path) -> None:
    write_atomically(path, json.dumps(accuracy_dict(report), indent=1, sort_keys=True) + "\n")


def load_accuracy(path: Path, warn=print) -> dict:
    data = read_saved(path, "accuracy baseline", "accuracy")
    changed = machine.differences(data.get("machine", {}), machine.describe())
    if changed:
        warn(f"warning: the accuracy baseline {path} was saved elsewhere; drift may reflect "
             f"the change: {'; '.join(changed)}")
    return data["errors"]


def drift_results(report: RunReport, baseline: dict, factor: float) -> list[Result]:
    """A failed ``drift/<check>`` result for every check whose error grew past ``factor``."""
    drifted = []
    for result in report.results:
        before = baseline.get(result.backend, {}).get(result.case, {}).get(result.check)
        if before is None or result.error is None or result.budget is None:
            continue
        floor = NOISE_FLOOR * result.budget
        growth = result.error / max(before, floor)
        if growth > factor and result.error > floor:
            drifted.append(Result(
                backend=result.backend, case=result.case, check=f"drift/{result.check}",
                status=Status.FAILED, error=result.error, budget=max(before, floor) * factor,
                message=(f"accuracy drift: error grew {growth:.1f}x ({before:.3g} -> "
                         f"{result.error:.3g}), past the allowed {factor:g}x; the budget is "
                         f"{result.budget:.3g}"),
                reproducer=result.reproducer))
    return sorted(drifted, key=lambda r: r.error / r.budget, reverse=True)
