"""``html``, ``summary`` and ``compare``: read saved reports back."""

from __future__ import annotations

import argparse

from conformance.inputs import check_output, read_json
from conformance.spec import SpecError


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
