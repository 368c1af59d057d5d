"""Reports: the terminal matrix and failure list, and the JSON report (schema in README)."""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from conformance import machine
from conformance.checks import CHECK_FAMILIES
from conformance.grouping import failure_groups, known_groups, results_by_family
from conformance.inputs import write_atomically
from conformance.status import FAILING, Status
from conformance.verdict import RunReport

SCHEMA = "paged-decode-conformance/report/1"
SKIPPED = (Status.UNSUPPORTED, Status.KNOWN_FAILURE, Status.CANNOT_JUDGE)  # in JUnit XML
# Cell letters of the terminal matrix, in the order they are shown.
MARKS = {Status.FAILED: "F", Status.ERROR: "E", Status.UNEXPECTED_PASS: "X",
         Status.KNOWN_FAILURE: "K", Status.UNSUPPORTED: "U", Status.CANNOT_JUDGE: "J"}
LEGEND = ("cell = checks passed, then F failed, E error, X unexpected pass (strict), "
          "K known failure (manifest), U unsupported, J cannot judge (the budget admits a "
          "trivially wrong answer)")


def _cell(counts: dict[str, int]) -> str:
    parts = [str(counts.get(Status.PASSED, 0))]
    parts += [f"{mark}{counts[status]}" for status, mark in MARKS.items() if counts.get(status)]
    return " ".join(parts)


def matrix(report: RunReport) -> list[list[str]]:
    """The backend x check-family matrix as data: a header row, then a row per backend."""
    cells: dict[str, dict[str, str]] = {}
    for backend, family, counts in results_by_family(report.results):
        cells.setdefault(backend, {})[family] = _cell(counts)
    families = [f for f in CHECK_FAMILIES if f in report.settings.families]
    families += sorted({r.family for r in report.results} - set(families))  # drift
    rows = [["backend", *families, "verdict"]]
    for backend in report.backends:
        row_cells = cells.get(backend.label, {})
        bad = any(r.status in FAILING for r in report.results if r.backend == backend.label)
        verdict = "FAIL" if bad else ("INTERRUPTED" if report.interrupted else "ok")
        rows.append([backend.label, *(row_cells.get(f, "-") for f in families), verdict])
    return rows


def matrix_lines(report: RunReport) -> list[str]:
    """The matrix as aligned text lines, for the terminal."""
    rows = matrix(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def write_terminal(report: RunReport, stream: TextIO, max_failures: int = 30) -> None:
    print(file=stream)
    print(f"profile {report.settings.profile}: {len(report.cases)} cases, "
          f"{len(report.results)} checks", file=stream)
    if report.interrupted:
        print(f"INTERRUPTED: {report.interrupted}; the results below are partial",
              file=stream)
    for line in matrix_lines(report):
        print("  " + line, file=stream)
    print("  " + LEGEND, file=stream)
    for problem in report.manifest_problems():
        print(f"  manifest: {problem}"
              f"{' (fails: --strict-manifest)' if report.strict_manifest else ''}", file=stream)
    for problem in report.unclaimed():
        print(f"  FAIL: {problem}", file=stream)
    if report.captured:
        total = sum(c.total_bytes for c in report.captured.values())
        print(f"  backend output: {total} bytes over {len(report.captured)} case(s), kept in "
              f"the JSON report (not shown here)", file=stream)
    for (backend, case), reasons in report.restarts.items():
        print(f"  worker replaced {len(reasons)}x in {backend} {case}: {reasons[0]}", file=stream)
    groups = known_groups(report)
    if groups:
        print(f"\nknown failures (manifest), {sum(g.count for g in groups)} in {len(groups)} "
              f"entr{'y' if len(groups) == 1 else 'ies'}:", file=stream)
    for g in groups:
        where = f" on {g.case}" if g.case else ""
        print(f"- {g.backend}: {g.count} x {g.check}{where}: {g.reason}"
              f"{f' [{g.link}]' if g.link else ''}\n  e.g. {g.example}", file=stream)
    failures = report.failures
    if not failures:
        print("\nno unexpected failures", file=stream)
        if report.interrupted:
            print("but the run was interrupted, so it fails: not every case ran", file=stream)
        elif report.unclaimed():
            print("but a backend claims no check of the run (above), so it fails", file=stream)
        elif not report.ok:
            print("but the manifest problems above fail the run (--strict-manifest)",
                  file=stream)
        return
    groups = failure_groups(failures)
    print(f"\n{len(failures)} unexpected failure(s)"
          f"{f' in {len(groups)} group(s) of one cause' if len(groups) < len(failures) else ''}"
          ":", file=stream)
    for group in groups[:max_failures]:
        result = group.smallest
        measured = ""
        if result.error is not None and result.budget is not None:
            measured = f" [error {result.error:.3g}, budget {result.budget:.3g}]"
        cases = len(group.results)
        shared = f" in {cases} cases of one cause ({group.cause}), the smallest:" \
            if cases > 1 else ""
        print(f"- {result.status.upper()} {result.backend} {result.check}{measured}{shared}\n"
              f"  case: {result.case}\n  {result.message}\n  rerun: {result.reproducer}",
              file=stream)
        others = [r.case for r in group.results if r is not result]
        if others:
            more = f", and {len(others) - 3} more (JSON report)" if len(others) > 3 else ""
            print(f"  also: {', '.join(others[:3])}{more}", file=stream)
    if len(groups) > max_failures:
        print(f"... and {len(groups) - max_failures} more group(s) (see the JSON report)",
              file=stream)


def _finite_or_text(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def report_dict(report: RunReport, argv: list[str] | None = None) -> dict:
    summary: dict[str, dict[str, dict[str, int]]] = {}
    for backend, family, counts in results_by_family(report.results):
        summary.setdefault(backend, {})[family] = counts
    results = []
    for result in report.results:
        row = result.as_dict()
        for key in ("error", "budget", "budget_table", "budget_ratio"):
            row[key] = _finite_or_text(row[key])
        results.append(row)
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": argv if argv is not None else sys.argv,
        "profile": report.settings.profile,
        "cases": len(report.cases),
        "families": list(report.settings.families),
        "selected": report.settings.filtered,
        "shard": "{}/{}".format(*report.settings.shard) if report.settings.shard else None,
        "expectations_dir": str(report.settings.manifest_dir or ""),
        "strict_manifest": report.strict_manifest,
        "spec": report.settings.spec_path or "built-in",
        "machine": report.recorded_machine or machine.describe(),
        "backends": [{**report.recorded_backends.get(b.label, b.describe()),
                      "device": report.devices.get(b.label, "")} for b in report.backends],
        "summary": summary,
        "ok": report.ok,
        "interrupted": report.interrupted,
        "results": results,
        "stale_expectations": [
            {"backend": b.label, "case": e.case, "check": e.check, "reason": e.reason,
             "line": e.line} for b, e in report.stale_expectations()],
        "unclaimed": report.unclaimed(),
        "captured_output": [{"backend": backend, "case": case, **captured.as_dict()}
                            for (backend, case), captured in report.captured.items()],
        "worker_restarts": [{"backend": backend, "case": case, "reasons": reasons}
                            for (backend, case), reasons in report.restarts.items()],
        "known_failures": [g.as_dict() for g in known_groups(report)],
        "durations": [{"backend": backend, "case": case, "seconds": round(seconds, 3)}
                      for (backend, case), seconds in report.durations.items()],
    }


def write_json(report: RunReport, path: str | Path, argv: list[str] | None = None) -> None:
    write_atomically(path, json.dumps(report_dict(report, argv), indent=1) + "\n")


_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def plain_text(text: str) -> str:
    """Text without terminal colour codes or characters XML 1.0 cannot hold."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", _ANSI.sub("", text))


def write_junit(report: RunReport, path: str | Path) -> None:
    """JUnit XML: a suite per backend, a test case per (case, check), each with its share of
    its case's time."""
    from xml.etree import ElementTree as ET

    root = ET.Element("testsuites", name="paged-decode-conformance")
    if report.interrupted or report.unclaimed():
        problems = ([report.interrupted] if report.interrupted else []) + report.unclaimed()
        suite = ET.SubElement(root, "testsuite", name="run", tests=str(len(problems)),
                              failures="0", errors=str(len(problems)), skipped="0")
        for problem in problems:
            case = ET.SubElement(suite, "testcase", classname="run", name="verdict")
            ET.SubElement(case, "error", message=plain_text(problem)[:200]).text = \
                plain_text(problem)
    checks_of: dict[tuple[str, str], int] = {}
    for r in report.results:
        checks_of[(r.backend, r.case)] = checks_of.get((r.backend, r.case), 0) + 1

    def seconds(result) -> float:
        """A sub-check's share of its case's time: the checks of a case share their work
        (one problem, one oracle), so the case's time is split among them equally."""
        key = (result.backend, result.case)
        return report.durations.get(key, 0.0) / checks_of[key]

    for backend in report.backends:
        results = [r for r in report.results if r.backend == backend.label]
        suite = ET.SubElement(root, "testsuite", name=backend.label, tests=str(len(results)),
                              time=f"{sum(map(seconds, results)):.3f}",
                              failures=str(sum(r.status in (Status.FAILED, Status.UNEXPECTED_PASS)
                                               for r in results)),
                              errors=str(sum(r.status == Status.ERROR for r in results)),
                              skipped=str(sum(r.status in SKIPPED for r in results)))
        for result in results:
            case = ET.SubElement(suite, "testcase", classname=backend.label,
                                 name=f"{result.case}::{result.check}",
                                 time=f"{seconds(result):.3f}")
            message = plain_text(result.message)
            text = f"{message}\nrerun: {result.reproducer}"
            if result.status in (Status.FAILED, Status.UNEXPECTED_PASS):
                ET.SubElement(case, "failure", message=message[:200]).text = text
            elif result.status == Status.ERROR:
                ET.SubElement(case, "error", message=message[:200]).text = text
            elif result.status in SKIPPED:
                ET.SubElement(case, "skipped", message=f"{result.status}: {message}"[:500])
    text = ET.tostring(root, encoding="unicode")
    write_atomically(path, "<?xml version='1.0' encoding='utf-8'?>\n" + text + "\n")


def accuracy_rows(report: RunReport) -> list[tuple[str, str, str, float, float, str]]:
    """Per backend, dtype and oracle check: the worst error, its budget and the case."""
    return worst_errors(r.as_dict() for r in report.results)


def worst_errors(results) -> list[tuple[str, str, str, float, float, str]]:
    """``accuracy_rows`` from result records as the JSON report holds them (dicts)."""
    worst: dict[tuple[str, str, str], tuple[float, float, str]] = {}
    for r in results:
        error, budget = r.get("error"), r.get("budget")
        if not (r["check"].startswith("oracle/") and isinstance(error, (int, float))
                and isinstance(budget, (int, float)) and budget):
            continue  # a non-finite error is a failure listed elsewhere
        key = (r["backend"], r.get("dtype", ""), r["check"])
        if key not in worst or error / budget > worst[key][0] / worst[key][1]:
            worst[key] = (error, budget, r["case"])
    return [(*key, *value) for key, value in sorted(worst.items())]


def code_span(text: str) -> str:
    """Text as a Markdown code span, copied as it is: fenced by more backticks than it holds
    in a row (CommonMark), on one line."""
    flat = " ".join(plain_text(text).split())
    fence = "`" * (max((len(run) for run in re.findall("`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def md(text: object) -> str:
    """Text safe inside a Markdown table cell or list item: one line, markup escaped."""
    flat = " ".join(plain_text(str(text)).split())
    return re.sub(r"([\\`*_{}\[\]<>|#])", r"\\\1", flat)


def write_markdown(report: RunReport, path: str | Path, max_failures: int = 50) -> None:
    """A summary for a CI job page: the matrix, the failures with reproducers, accuracy."""
    lines = [f"## Conformance: profile `{report.settings.profile}`, {len(report.cases)} cases",
             "", "**" + ("PASS" if report.ok else "FAIL") + "**", ""]
    if report.interrupted:
        lines += [f"Interrupted ({md(report.interrupted)}): the results below are partial.", ""]
    lines += [f"- {md(problem)}" for problem in report.unclaimed()]
    table = [[md(cell) for cell in row] for row in matrix(report)]
    lines += ["| " + " | ".join(table[0]) + " |", "|" + " --- |" * len(table[0])]
    lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
    lines += ["", LEGEND, ""]
    groups = known_groups(report)
    if groups:
        lines += [f"### {sum(g.count for g in groups)} known failure(s) (manifest)", "",
                  "| backend | checks | check | cases | reason | finding |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {md(g.backend)} | {g.count} | {md(g.check)} | {md(g.case or g.example)} | "
                  f"{md(g.reason)} | {md(g.link)} |" for g in groups]
        lines.append("")
    failures = report.failures
    if failures:
        groups = failure_groups(failures)
        lines += [f"### {len(failures)} unexpected failure(s) in {len(groups)} group(s)", ""]
        for group in groups[:max_failures]:
            r = group.smallest
            measured = f" (error {r.error:.3g}, budget {r.budget:.3g})" if (
                r.error is not None and r.budget is not None) else ""
            shared = f" in {len(group.results)} cases ({md(group.cause)}), the smallest" \
                if len(group.results) > 1 else ""
            lines += [f"- **{r.status}** {md(r.backend)} {md(r.check)}{shared}{measured} on "
                      f"{md(r.case)}: {md(r.message)}", f"  {code_span(r.reproducer)}"]
        if len(groups) > max_failures:
            lines.append(f"- ... {len(groups) - max_failures} more group(s) in the JSON report")
        lines.append("")
    rows = accuracy_rows(report)
    if rows:
        lines += ["### Accuracy (worst error / budget per backend, dtype and check)", "",
                  "| backend | dtype | check | error | budget | case |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {md(b)} | {d} | {c} | {e:.3g} | {g:.3g} | {md(case)} |"
                  for b, d, c, e, g, case in rows]
    write_atomically(path, "\n".join(lines) + "\n")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """A one-line progress bar on a terminal (as wide as the terminal), a line every 10%
    elsewhere; both with the time left at the pace so far and the failures so far."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self.last_decile = -1

    def __call__(self, done: int, total: int, label: str, failing: int = 0) -> None:
        elapsed = time.monotonic() - self.start
        left = f", ~{_duration(elapsed / done * (total - done))} left" if 0 < done < total else ""
        status = f"{done}/{total} cases, {elapsed:.1f}s{left}, {failing} failing"
        if self.tty:
            columns = shutil.get_terminal_size((100, 24)).columns - 1
            width = max(10, min(30, columns // 4))
            filled = width * done // max(total, 1)
            text = f"[{'#' * filled}{'.' * (width - filled)}] {status} "
            self.stream.write("\r" + (text + label)[:columns].ljust(columns))
            if done == total:
                self.stream.write("\n")
        elif done * 10 // max(total, 1) > self.last_decile:
            self.last_decile = done * 10 // max(total, 1)
            self.stream.write(status + "\n")
        self.stream.flush()
