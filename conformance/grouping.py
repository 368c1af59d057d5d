"""Results grouped for a reader: known failures by the manifest entry that lists them,
unexpected failures by their cause, so that one bug is printed once."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from conformance.result import Result
from conformance.status import Status
from conformance.verdict import RunReport


@dataclass(frozen=True)
class KnownGroup:
    """The known failures of one manifest entry: what a reader needs in place of a count."""

    backend: str
    case: str  # the entry's case pattern (the reason alone when no entry is at hand)
    check: str
    reason: str
    link: str
    count: int
    example: str  # the first case it held

    def as_dict(self) -> dict:
        return {"backend": self.backend, "case": self.case, "check": self.check,
                "reason": self.reason, "link": self.link, "count": self.count,
                "example": self.example}


def known_groups(report: RunReport) -> list[KnownGroup]:
    """Known failures grouped by the manifest entry that listed them, in report order."""
    backends = {b.label: b for b in report.backends}
    groups: dict[tuple, list] = {}
    for r in report.results:
        if r.status != Status.KNOWN_FAILURE:
            continue
        backend = backends.get(r.backend)
        entry = backend.manifest.lookup(r.case, r.check, report.devices.get(r.backend)) \
            if backend is not None else None
        key = (r.backend, entry.line if entry else r.message)
        if key not in groups:
            groups[key] = [entry, r, 0]
        groups[key][2] += 1
    return [KnownGroup(r.backend, entry.case, entry.check, entry.reason, entry.link, count, r.case)
            if entry else KnownGroup(r.backend, "", r.check, r.message, "", count, r.case)
            for entry, r, count in groups.values()]


@dataclass(frozen=True)
class FailureGroup:
    """Unexpected failures of one check on one backend that share a cause: the same query
    heads wrong (``Result.wrong_heads``), or else the same message but for its numbers. Printed
    once, by its smallest case; the JSON report keeps every result."""

    cause: str
    results: tuple[Result, ...]

    @property
    def smallest(self) -> Result:
        return min(self.results, key=lambda r: (r.context or 0, len(r.case)))


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def failure_groups(failures: list[Result]) -> list[FailureGroup]:
    """The failures grouped by cause, in the order their first member failed."""
    groups: dict[tuple[str, str, str, str], list[Result]] = {}
    for result in failures:
        cause = f"wrong in heads {result.wrong_heads}" if result.wrong_heads else \
            _NUMBER.sub("#", result.message.split(" at [")[0])
        groups.setdefault((result.backend, result.status, result.check, cause), []).append(
            result)
    return [FailureGroup(key[3], tuple(members)) for key, members in groups.items()]


def results_by_family(results: Iterable[Result]) -> Iterator[tuple[str, str, dict[str, int]]]:
    """(backend, family, {status: count}) in first-seen order."""
    table: dict[tuple[str, str], dict[str, int]] = {}
    for result in results:
        counts = table.setdefault((result.backend, result.family), {})
        counts[result.status] = counts.get(result.status, 0) + 1
    for (backend, family), counts in table.items():
        yield backend, family, counts
