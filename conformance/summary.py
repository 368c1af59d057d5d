"""A cross-backend table from saved JSON reports: what each backend claims, passes and deviates in.

``python -m conformance summary REPORT[=MACHINE][@BACKEND,...] ...`` prints one Markdown row
per backend and report (only the named backends, when given), so the README's table is
generated from runs, not typed. Reports may be gzipped.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from conformance.inputs import InputError, read_saved
from conformance.status import FAILING, Status

COLUMNS = ("backend", "machine", "profile", "cases claimed", Status.PASSED, "known failure",
           Status.UNSUPPORTED, "cannot judge", "failed or error", "findings")


def load_report(path: str | Path) -> dict:
    """A saved JSON report (``.json`` or ``.json.gz``), validated against its schema."""
    return read_saved(path, "report", "report")


def findings(report: dict, backend: str) -> list[str]:
    """The finding pages behind a backend's known failures, from its manifest's links."""
    from conformance.manifest import load_manifest

    described = next((b for b in report["backends"] if b["name"] == backend), {})
    manifest_path = described.get("expectations") or ""
    if not manifest_path or not Path(manifest_path).exists():
        manifest = load_manifest(backend)
    else:
        manifest = load_manifest(backend, Path(manifest_path).parent)
    reasons = {r["message"] for r in report["results"]
               if r["backend"] == backend and r["status"] == Status.KNOWN_FAILURE}
    links = {e.link for e in manifest.entries
             if e.link and any(e.reason in message for message in reasons)}
    return sorted(links)


def rows(report: dict, machine: str, only: tuple[str, ...] = ()) -> list[list[str]]:
    table = []
    per_backend = Counter(backend for backend, _ in
                          {(r["backend"], r["case"]) for r in report["results"]})
    total_cases = report.get("cases") or max(per_backend.values(), default=0)
    for described in report["backends"]:
        backend = described["name"]
        if only and backend not in only:
            continue
        results = [r for r in report["results"] if r["backend"] == backend]
        counts = Counter(r["status"] for r in results)
        cases = {r["case"] for r in results}
        claimed = {r["case"] for r in results if r["status"] != Status.UNSUPPORTED}
        profile = report["profile"]
        if len(cases) < total_cases:
            profile += f" (partial: {len(cases)} cases ran)"
        links = [f"[{Path(link).stem}]({link})" for link in findings(report, backend)]
        device = described.get("device")
        where = f"{machine}, {device}" if device and device not in machine else machine
        table.append([backend, where, profile, str(len(claimed)),
                      str(counts[Status.PASSED]), str(counts[Status.KNOWN_FAILURE]),
                      str(counts[Status.UNSUPPORTED]), str(counts[Status.CANNOT_JUDGE]),
                      str(sum(counts[status] for status in FAILING)),
                      ", ".join(links) or "-"])
    return table


def markdown(sources: list[tuple[dict, str, tuple[str, ...]]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for report, machine, only in sources:
        lines += ["| " + " | ".join(row) + " |" for row in rows(report, machine, only)]
    return "\n".join(lines) + "\n"


def parse_source(text: str) -> tuple[dict, str, tuple[str, ...]]:
    """``PATH[=MACHINE][@BACKEND,...]``: a report, the machine to name it by, and the backends
    to take from it (all when none are named)."""
    text, _, only = text.partition("@")
    path, _, machine = text.partition("=")
    report = load_report(path)
    names = tuple(name for name in only.split(",") if name)
    known = {b["name"] for b in report["backends"]}
    missing = [name for name in names if name not in known]
    if missing:
        raise InputError(f"report {path!r} has no backend {missing[0]!r}; it has "
                         f"{', '.join(sorted(known))}")
    return report, machine or report.get("machine", {}).get("platform", "?"), names
