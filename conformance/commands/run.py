"""``run``, ``merge`` and ``expectations update``: judge backends, and keep what was found."""

from __future__ import annotations

import argparse
import sys
import time

from conformance.accuracy import drift_results, load_accuracy, save_accuracy
from conformance.backends.registry import known_backends
from conformance.checks import CHECK_FAMILIES
from conformance.commands import (
    forking,
    job_count,
    loaded_once,
    loading,
    open_named,
    settings_from,
)
from conformance.inputs import check_directory, check_outputs
from conformance.interrupts import protect_reports, stop_on_signals
from conformance.parallel import pool_environment
from conformance.report import Progress, write_json, write_junit, write_markdown, write_terminal
from conformance.runner import pool_size, run, start_pool
from conformance.selection import select_cases
from conformance.session import BackendRun, check_families, open_backends
from conformance.spec import SpecError, check_sizes
from conformance.status import BROKEN
from conformance.zygote import fork_note


def _check_run_inputs(args: argparse.Namespace) -> None:
    """Every path option, before anything runs: a typo costs a second, not a whole run."""
    if getattr(args, "expectations", None) is not None:
        check_directory(args.expectations, "--expectations")
    check_outputs(args, REPORT_OPTIONS)


def handle_run(args: argparse.Namespace) -> int:
    _check_run_inputs(args)
    settings = settings_from(args, families=check_families(args.check or CHECK_FAMILIES),
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
    jobs = job_count(args.jobs)
    targets = args.backend or sorted(known_backends())
    size = pool_size(jobs, len(cases) * len(targets))
    with loaded_once(targets, args, pool_environment(size) if size else None):
        # named backends: the -j workers start loading the first while its probe runs
        pool = (start_pool(jobs, len(cases) * len(args.backend), args.backend[0])
                if args.backend and not args.in_process else None)
        try:
            backends = _open_backends(args)
            if backends is None:
                return 2
            started = time.monotonic()
            stop_on_signals()
            report = run(backends, cases, settings, Progress(), jobs=jobs, pool=pool)
            how_started = {b.label: fork_note(b.target) for b in backends} if forking(args) else {}
        finally:
            if pool is not None:
                pool.close()
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
        if how_started.get(backend.label):
            print(f"{backend.label}: {how_started[backend.label]}")
    written = write_reports(report, args)
    sys.stdout.flush()
    if report.interrupted:
        return 130
    if not written:
        return 2
    return 0 if report.ok else 1


def _open_backends(args: argparse.Namespace) -> list[BackendRun] | None:
    """The named backends (None when one cannot run here), or every available one."""
    if args.backend:
        return open_named(args.backend, args)
    backends = open_backends(sorted(known_backends()), args.expectations, **loading(args))
    for backend in backends:
        if backend.reason:
            print(f"skipping backend {backend.label}: {backend.reason}", file=sys.stderr)
    return [b for b in backends if b.reason is None]


REPORT_OPTIONS = ("report_json", "junit_xml", "summary_md", "save_accuracy")


def write_reports(report, args: argparse.Namespace) -> bool:
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
    if not write_reports(report, args):
        return 2
    return 0 if report.ok else 1


def handle_expectations(args: argparse.Namespace) -> int:
    from conformance.manifest import EXPECTATIONS_DIR, append_entries

    if args.expectations is not None:
        check_directory(args.expectations, "--expectations")
    settings = settings_from(args)
    named = open_named([args.backend], args)
    if named is None:
        return 2
    backend = named[0]
    cases = select_cases(settings.spec(), args.profile)
    check_sizes(cases, args.max_case_mib)
    report = run([backend], cases, settings, Progress(), jobs=job_count(args.jobs))
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
