"""The one status vocabulary every result, manifest, report and plugin speaks."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """What happened to one sub-check of one case on one backend (a ``str``: JSON as is)."""

    PASSED = "passed"
    FAILED = "failed"  # the backend ran and was wrong
    ERROR = "error"  # the backend raised, died, hung or could not be reached
    UNSUPPORTED = "unsupported"  # outside what the backend claims, with the reason
    # within a budget that also admits a trivially wrong answer (zeros, the mean of V, one
    # token dropped) on this case: no pass, since the check could not have failed
    CANNOT_JUDGE = "cannot-judge"
    KNOWN_FAILURE = "known-failure"  # failed or erred, and listed in the manifest
    UNEXPECTED_PASS = "unexpected-pass"  # listed in the manifest, and passed


# What fails a run, and what counts as "did not pass" before a manifest is applied.
FAILING = frozenset({Status.FAILED, Status.ERROR, Status.UNEXPECTED_PASS})
BROKEN = frozenset({Status.FAILED, Status.ERROR})
