"""What each ``python -m conformance`` command does, given its parsed arguments.

``conformance.cli`` builds the parsers and dispatches here; each handler returns the exit
status. Work that belongs to one subject (bench timing, explore, TVM builds) lives in that
subject's module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from conformance.accuracy import drift_results, load_accuracy, save_accuracy
from conformance.backends.registry import known_backends
from conformance.checks import CHECK_FAMILIES
from conformance.inputs import check_directory, check_distinct, check_output, read_json
from conformance.interrupts import protect_reports, stop_on_signals
from conformance.report import Progress, write_json, write_junit, write_markdown, write_terminal
from conformance.runner import RunSettings, check_families, open_backend, open_backends, run
from conformance.selection import select_cases
from conformance.skeleton import class_name, write_skeleton
from conformance.spec import SpecError, check_sizes
from conformance.status import BROKEN


def handle_backends(args: argparse.Namespace) -> int:
    for backend in open_backends(sorted(known_backends())):
        name = backend.target
        state = "available" if backend.reason is None else f"unavailable: {backend.reason}"
        print(f"{name}: {state}")
        if backend.declared.description:
            print(f"  {backend.declared.description}")
        for key, value in backend.capabilities.describe().items():
            print(f"  {key}: {value}")
        conventions = backend.declared.conventions.describe()
        print(f"  conventions: LSE base {conventions['lse_base']}, empty-context LSE "
              f"{conventions['empty_lse']}")
    return 0


def handle_list(args: argparse.Namespace) -> int:
    settings = RunSettings(profile=args.profile, spec_path=args.spec)
    for case in select_cases(settings.spec(), args.profile, args.patterns):
        print(case.id)
    return 0


def _settings(args: argparse.Namespace, **more) -> RunSettings:
    return RunSettings(profile=args.profile, spec_path=args.spec, manifest_dir=args.expectations,
                       isolated=not args.in_process, case_timeout=args.case_timeout, **more)


def _loading(args: argparse.Namespace) -> dict:
    """How backends are loaded: in a worker within the case timeout, or here to debug."""
    return {"isolated": not args.in_process, "load_timeout": args.case_timeout or None}


def _check_run_inputs(args: argparse.Namespace) -> None:
    """Every path option, before anything runs: a typo costs a second, not a whole run."""
    if getattr(args, "expectations", None) is not None:
        check_directory(args.expectations, "--expectations")
    for option in REPORT_OPTIONS:
        if getattr(args, option, None) is not None:
            check_output(getattr(args, option), "--" + option.replace("_", "-"))
    check_distinct({"--" + option.replace("_", "-"): getattr(args, option, None)
                    for option in REPORT_OPTIONS})


def handle_run(args: argparse.Namespace) -> int:
    _check_run_inputs(args)
    settings = _settings(args, families=check_families(args.check or CHECK_FAMILIES),
                         filtered=bool(args.patterns or args.case or args.check),
                         allow_empty=args.allow_empty)
    cases = select_cases(settings.spec(), args.profile, args.patterns, args.case)
    if not cases:
        print("error: no case matches the selection", file=sys.stderr)
        return 2
    if args.shard:
        from conformance.shards import parse_shard, shard_cases

        settings.shard = parse_shard(args.shard)
        if settings.shard[1] > len(cases):
            raise SpecError(f"--shard {args.shard!r}: {settings.shard[1]} shards of "
                            f"{len(cases)} selected cases; at most one shard per case")
        cases = shard_cases(cases, settings.shard)
    check_sizes(cases, args.max_case_mib)
    baseline = (load_accuracy(args.compare_accuracy, warn=lambda line: print(line, file=sys.stderr))
                if args.compare_accuracy else None)
    if args.backend:
        backends = open_backends(args.backend, args.expectations, **_loading(args))
        unavailable = [b for b in backends if b.reason]
        for backend in unavailable:
            print(f"error: backend {backend.label!r} is unavailable here: {backend.reason}",
                  file=sys.stderr)
        if unavailable:
            return 2
    else:
        backends = open_backends(sorted(known_backends()), args.expectations, **_loading(args))
        for backend in backends:
            if backend.reason:
                print(f"skipping backend {backend.label}: {backend.reason}", file=sys.stderr)
        backends = [b for b in backends if b.reason is None]
    started = time.monotonic()
    stop_on_signals()
    report = run(backends, cases, settings, Progress(), jobs=_job_count(args.jobs))
    protect_reports()
    if baseline is not None:
        report.results.extend(drift_results(report, baseline, args.drift_factor))
    report.strict_manifest = args.strict_manifest
    write_terminal(report, sys.stdout)
    print(f"\n{time.monotonic() - started:.1f}s for {len(backends)} backend(s): "
          f"{', '.join(b.label for b in backends)}")
    if args.durations:
        print(f"slowest {args.durations} case(s):")
        for backend, case, seconds in report.slowest(args.durations):
            print(f"  {seconds:8.2f}s  {backend}  {case}")
    for backend in backends:
        for note in backend.notes:
            print(f"{backend.label}: {note}")
    written = _write_reports(report, args)
    sys.stdout.flush()
    if report.interrupted:
        return 130
    if not written:
        return 2
    return 0 if report.ok else 1


REPORT_OPTIONS = ("report_json", "junit_xml", "summary_md", "save_accuracy")


def _write_reports(report, args: argparse.Namespace) -> bool:
    """Write every report asked for; one that cannot be written is an error line, and the
    others are still written. False when one could not be."""
    written = True
    for option, writer in zip(REPORT_OPTIONS, (write_json, write_junit, write_markdown,
                                               save_accuracy), strict=True):
        path = getattr(args, option, None)
        if not path:
            continue
        try:
            writer(report, path)
        except OSError as exc:
            print(f"error: --{option.replace('_', '-')} {str(path)!r} could not be written: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            written = False
            continue
        print(f"wrote {path}")
    return written


def handle_merge(args: argparse.Namespace) -> int:
    from conformance.shards import merge_reports

    _check_run_inputs(args)
    report = merge_reports(args.shards)
    write_terminal(report, sys.stdout)
    if not _write_reports(report, args):
        return 2
    return 0 if report.ok else 1


def _job_count(jobs: int) -> int:
    return jobs if jobs > 0 else (os.cpu_count() or 1)


def handle_html(args: argparse.Namespace) -> int:
    from conformance.html_report import write_html
    from conformance.summary import load_report

    check_output(args.out, "--out")
    report = load_report(args.report_json)
    bench = read_json(args.bench_json, "--bench-json") if args.bench_json else None
    write_html(report, args.out, bench)
    print(f"wrote {args.out}")
    return 0


def handle_summary(args: argparse.Namespace) -> int:
    from conformance.summary import markdown, parse_source

    print(markdown([parse_source(text) for text in args.reports]), end="")
    return 0


def handle_compare(args: argparse.Namespace) -> int:
    from conformance.compare import compare, different_runs, render
    from conformance.summary import load_report

    old, new = load_report(args.old), load_report(args.new)
    if not args.allow_different_runs:
        mismatch = different_runs(old, new)
        if mismatch:
            raise SpecError(f"compare {args.old} {args.new}: the reports did not run the same "
                            f"thing ({mismatch}), so what one lacks would go unnoticed; pass "
                            f"--allow-different-runs if that is meant")
    changes = compare(old, new, args.error_factor)
    print(render(changes), end="")
    return 1 if changes["newly failing"] else 0


def handle_expectations(args: argparse.Namespace) -> int:
    from conformance.manifest import EXPECTATIONS_DIR, append_entries

    if args.expectations is not None:
        check_directory(args.expectations, "--expectations")
    settings = _settings(args)
    backend = open_backend(args.backend, args.expectations, **_loading(args))
    if backend.reason:
        print(f"error: backend {backend.label!r} is unavailable here: {backend.reason}",
              file=sys.stderr)
        return 2
    cases = select_cases(settings.spec(), args.profile)
    check_sizes(cases, args.max_case_mib)
    report = run([backend], cases, settings, Progress(), jobs=_job_count(args.jobs))
    failing = sorted({(r.case, r.check) for r in report.failures if r.status in BROKEN})
    if not failing:
        print(f"{backend.label}: no unexpected failures on profile {args.profile}; "
              f"nothing to add")
        return 0
    note = (f"added by `python -m conformance expectations update --backend {args.backend} "
            f"--profile {args.profile}` on {time.strftime('%Y-%m-%d')}")
    path = append_entries(backend.manifest, failing, args.expectations or EXPECTATIONS_DIR,
                          note)
    print(f"appended {len(failing)} entries to {path}, each with a placeholder reason:")
    for case_id, check in failing:
        print(f"  {check}  {case_id}")
    print("replace each placeholder with the reason (--strict-manifest fails until then)")
    return 0


def handle_new_backend(args: argparse.Namespace) -> int:
    out = args.out or Path(f"{args.name.replace('-', '_')}.py")
    write_skeleton(args.name, out)
    print(f"wrote {out}; run it with: python -m conformance run --backend "
          f"{out}:{class_name(args.name)} --profile smoke --allow-empty")
    return 0
