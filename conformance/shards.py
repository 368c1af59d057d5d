"""Beyond one machine the CI system is the engine: a run takes a share of the cases
(``--shard K/N``), and ``merge`` joins the shards' JSON reports into the report one run
would have written.

Shares are balanced by expected cost (the bytes a case materialises, which tracks tokens x
heads x head_dim), not by count, and are deterministic: the same spec and N give the same
shares on every machine.
"""

from __future__ import annotations

import heapq
import re
from pathlib import Path

from conformance.inputs import InputError
from conformance.spec import Case


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` with 1 <= K <= N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise InputError(f"--shard {text!r}: want K/N with 1 <= K <= N, e.g. 2/4")
    return int(match[1]), int(match[2])


def shard_cases(cases: list[Case], shard: tuple[int, int]) -> list[Case]:
    """The cases of shard K of N, in spec order: the costliest case goes to the least loaded
    shard first (ties to the lower shard), so the shares' costs stay close."""
    k, n = shard
    loads = [(0, index) for index in range(n)]
    owner: dict[str, int] = {}
    for case in sorted(cases, key=lambda c: (-c.problem_bytes, c.id)):
        load, index = heapq.heappop(loads)
        owner[case.id] = index
        heapq.heappush(loads, (load + case.problem_bytes, index))
    return [case for case in cases if owner[case.id] == k - 1]


def merge_reports(paths: list[Path]):
    """The ``RunReport`` a single run would have made, from the shards' JSON reports."""
    from conformance.backends.registry import UnknownBackendError
    from conformance.checks import CHECK_FAMILIES
    from conformance.result import Result
    from conformance.sandbox import Captured
    from conformance.session import BackendRun, RunSettings, open_backends
    from conformance.summary import load_report
    from conformance.verdict import RunReport

    reports = [load_report(path) for path in paths]
    first = reports[0]
    same = ("profile", "spec", "families", "expectations_dir")
    for path, report in zip(paths, reports, strict=True):
        for key in same:
            if report.get(key) != first.get(key):
                raise InputError(f"shard report {str(path)!r}: {key} {report.get(key)!r} "
                                 f"differs from {first.get(key)!r} in {str(paths[0])!r}")
        if [b["target"] for b in report["backends"]] != [b["target"] for b in first["backends"]]:
            raise InputError(f"shard report {str(path)!r}: other backends than {paths[0]}")
    shards = sorted(tuple(map(int, r["shard"].split("/"))) for r in reports if r.get("shard"))
    total = shards[0][1] if shards else 0
    if [s for s, _ in shards] != list(range(1, total + 1)) or len(shards) != len(reports):
        raise InputError(f"the reports are shards {[f'{s}/{n}' for s, n in shards]}: want each "
                         f"of 1..N exactly once")
    manifest_dir = Path(first["expectations_dir"]) if first.get("expectations_dir") else None
    settings = RunSettings(profile=first["profile"],
                           spec_path=None if first["spec"] == "built-in" else first["spec"],
                           families=tuple(first.get("families", CHECK_FAMILIES)),
                           manifest_dir=manifest_dir,
                           filtered=any(r.get("selected") for r in reports))
    if all("declared" in b for b in first["backends"]):
        try:
            backends = [BackendRun.recorded(b, manifest_dir) for b in first["backends"]]
        except UnknownBackendError as exc:
            raise InputError(f"shard report {str(paths[0])!r}: {exc}") from None
    else:  # written before reports recorded declarations: ask the backends themselves
        backends = open_backends([b["target"] for b in first["backends"]], manifest_dir)
    ran = {row["case"] for report in reports for row in report["results"]}
    cases = [c for c in settings.spec().cases(settings.profile) if c.id in ran]
    unknown = ran - {c.id for c in cases}
    if unknown:
        raise InputError(f"shard reports hold case {sorted(unknown)[0]!r}, which profile "
                         f"{settings.profile} of spec {first['spec']} does not")
    strangers = {row["backend"] for report in reports for row in report["results"]} - {
        b.label for b in backends}
    if strangers:
        raise InputError(f"shard reports hold results of backend {sorted(strangers)[0]!r}, "
                         f"which they do not describe")
    order = {case.id: index for index, case in enumerate(cases)}
    rank = {backend.label: index for index, backend in enumerate(backends)}
    rows = sorted((row for report in reports for row in report["results"]),
                  key=lambda row: (rank[row["backend"]], order[row["case"]]))
    merged = RunReport(settings, backends, cases,
                       strict_manifest=any(r.get("strict_manifest") for r in reports),
                       interrupted="; ".join(r["interrupted"] for r in reports
                                             if r.get("interrupted")))
    for row in rows:
        fields = {k: v for k, v in row.items() if k != "family"}
        for key in ("error", "budget", "budget_table", "budget_ratio"):
            if isinstance(fields[key], str):
                fields[key] = float(fields[key])
        merged.results.append(Result(**fields))
    for report in reports:
        for entry in report.get("captured_output", []):
            merged.captured[(entry["backend"], entry["case"])] = Captured(entry["bytes"],
                                                                          entry["tail"])
        for entry in report.get("worker_restarts", []):
            merged.restarts[(entry["backend"], entry["case"])] = entry["reasons"]
        for entry in report.get("durations", []):
            merged.durations[(entry["backend"], entry["case"])] = entry["seconds"]
        for backend in report["backends"]:
            if backend.get("device"):
                merged.devices[backend["name"]] = backend["device"]
        for backend, described in zip(backends, report["backends"], strict=True):
            backend.notes = backend.notes or described.get("notes", [])
            recorded = merged.recorded_backends.get(backend.label)
            if recorded is None or (described.get("available") and not recorded.get("available")):
                merged.recorded_backends[backend.label] = {
                    k: v for k, v in described.items() if k != "device"}
    machines = [report.get("machine") for report in reports]
    if machines[0] and all(m == machines[0] for m in machines):
        merged.recorded_machine = machines[0]
    elif any(machines):
        merged.recorded_machine = {"shards": machines}
    merged.captured = dict(sorted(merged.captured.items(),
                                  key=lambda item: (rank[item[0][0]], order[item[0][1]])))
    return merged
