"""``explore``: search what a backend claims, print each finding as a spec entry, save them."""

from __future__ import annotations

import argparse
import json
import sys

from conformance.checks import CHECK_FAMILIES
from conformance.commands import loaded_once, open_named
from conformance.explore import (
    REGRESSION_PROFILE,
    as_listed,
    entry_name,
    explore,
    print_progress,
    save_spec,
)
from conformance.inputs import InputError, check_directory, check_outputs, write_atomically
from conformance.interrupts import protect_reports, stop_on_signals
from conformance.session import RunSettings, check_families


def handle_explore(args: argparse.Namespace) -> int:
    """``python -m conformance explore``: search, print each finding as a spec entry, save."""
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("error: explore searches with Hypothesis, which is not installed here: pip install "
              "'paged-decode-conformance[explore]'", file=sys.stderr)
        return 2
    check_outputs(args, ("save_spec", "report_json"))
    if args.expectations is not None:
        check_directory(args.expectations, "--expectations")
    if args.database is not None and args.database.exists() and not args.database.is_dir():
        raise InputError(f"--database {str(args.database)!r}: not a folder")
    settings = RunSettings(profile="explore", families=check_families(args.checks or
                                                                      CHECK_FAMILIES),
                           manifest_dir=args.expectations, isolated=not args.in_process,
                           case_timeout=args.case_timeout)
    with loaded_once([args.backend], args):  # a worker replaced after each fault: forked
        named = open_named([args.backend], args)
        if named is None:
            return 2
        backend = named[0]
        if args.fp8 and not backend.capabilities.kv_dtypes:
            print(f"error: --fp8: backend {backend.label!r} claims no fp8 cache (its kv_dtypes "
                  f"are empty)", file=sys.stderr)
            return 2
        stop_on_signals()
        try:
            state = explore(backend, settings, args.max_examples, args.time_budget, args.seed,
                            args.database, progress=print_progress, fp8=args.fp8)
        finally:
            backend.disconnect()
    if state.replayed:
        print(f"replayed {state.replayed} saved finding(s) from "
              f"{args.database / (backend.label + '.toml')} first: {state.still_failing} "
              f"still fail")
    protect_reports()
    ended = " (interrupted)" if state.interrupted else \
        " (time budget reached)" if state.stopped_early else ""
    print(f"\nexplored {backend.label}: {state.examples} examples in {state.seconds:.1f}s"
          f"{ended}, seed {args.seed}, "
          f"{state.rounds} round(s); "
          f"{len(state.findings)} failing check(s)")
    if state.judged:
        print("judged: " + ", ".join(f"{name} {count}" for name, count in
                                     state.judged.most_common()))
    entries, rows = [], []
    for number, finding in enumerate(state.findings.values(), start=1):
        name = entry_name(backend.label, finding, number)
        entry = finding.spec_entry(name)
        case_id = as_listed(finding.case, name).id
        spec = args.save_spec or "regressions.toml"
        rerun = (f"python -m conformance run --backend {args.backend} --spec {spec} --profile "
                 f"{REGRESSION_PROFILE} --case '{case_id}'")
        print(f"\n- {finding.result.status.upper()} {finding.check}: {finding.result.message}"
              f"\n  smallest case: {finding.case.id}\n\n{entry}\n  rerun: {rerun}")
        entries.append(entry)
        rows.append({"check": finding.check, "status": finding.result.status,
                     "message": finding.result.message, "case": finding.case.id,
                     "spec_entry": entry, "reproducer": rerun})
    if entries and args.save_spec:
        save_spec(args.save_spec, entries)
        print(f"\nappended {len(entries)} case(s) to {args.save_spec}")
    elif entries:
        print("\nkeep them with --save-spec FILE (a spec that `run --spec FILE` replays)")
    if args.report_json:
        write_atomically(args.report_json, json.dumps(
            {"schema": "paged-decode-conformance/explore/1", "backend": backend.label,
             "seed": args.seed, "examples": state.examples, "seconds": state.seconds,
             "stopped_early": state.stopped_early, "interrupted": state.interrupted,
             "rounds": state.rounds, "judged": dict(state.judged),
             "findings": rows}, indent=1) + "\n")
    if state.interrupted:
        return 130
    return 1 if state.findings else 0
