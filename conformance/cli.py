"""``python -m conformance``: list backends and cases, run the suite, search, compare, report.

Each subcommand is a parser built from shared parents (the spec, the worker, parallel runs)
and a handler set with ``set_defaults``; work that belongs to one subject (bench timing,
explore, TVM builds) lives in that subject's module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from backends.registry import UnknownBackendError, known_backends
from conformance.accuracy import drift_results, load_accuracy, save_accuracy
from conformance.checks import CHECK_FAMILIES
from conformance.inputs import check_directory, check_distinct, check_output, read_json
from conformance.interrupts import protect_reports, stop_on_signals
from conformance.manifest import ManifestError
from conformance.report import Progress, write_json, write_junit, write_markdown, write_terminal
from conformance.runner import (
    DEFAULT_CASE_TIMEOUT,
    MAX_SECONDS,
    RunSettings,
    check_families,
    open_backend,
    open_backends,
    run,
    select_cases,
)
from conformance.skeleton import class_name, write_skeleton
from conformance.spec import DEFAULT_MAX_CASE_MIB, SpecError, check_sizes
from conformance.status import BROKEN


def _jobs(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (one per core) or more, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 and at most "
                                         f"{MAX_SECONDS}, got {text}")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite factor >= 1, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _parents() -> dict[str, argparse.ArgumentParser]:
    """Options several subcommands share, each written once."""
    spec = argparse.ArgumentParser(add_help=False)
    # the default depends on the command (PROFILE_DEFAULTS); a set_defaults on one command
    # would change this shared action for every command
    spec.add_argument("--profile", default=None, help="default: ci (full for build)")
    spec.add_argument("--spec", help="a spec TOML other than the built-in one")
    worker = argparse.ArgumentParser(add_help=False)
    worker.add_argument("--case-timeout", type=_seconds, default=DEFAULT_CASE_TIMEOUT,
                        metavar="SECONDS",
                        help=f"kill a backend that spends longer on one case and report the "
                             f"case as an error (default {DEFAULT_CASE_TIMEOUT:g}; 0: never)")
    worker.add_argument("--in-process", action="store_true",
                        help="call the backend in this process, to debug it with a debugger: "
                             "no isolation, no case timeout, its output not captured")
    worker.add_argument("--expectations", type=Path,
                        help="directory of expectation manifests (default: expectations/)")
    parallel = argparse.ArgumentParser(add_help=False)
    parallel.add_argument("-j", "--jobs", type=_jobs, default=1,
                          help="cases in parallel (0: one per CPU core)")
    parallel.add_argument("--max-case-mib", type=_positive, default=DEFAULT_MAX_CASE_MIB,
                          help=f"refuse cases whose arrays would be larger (default "
                               f"{DEFAULT_MAX_CASE_MIB})")
    return {"spec": spec, "worker": worker, "parallel": parallel}


def _parser() -> argparse.ArgumentParser:
    from backends.tvm.kernels import build_command
    from conformance.bench import bench_command
    from conformance.explore import explore_command

    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parents = _parents()

    def command(name: str, handler: Callable[[argparse.Namespace], int], help: str,
                *uses: str) -> argparse.ArgumentParser:
        made = sub.add_parser(name, help=help, parents=[parents[use] for use in uses])
        made.set_defaults(handler=handler)
        return made

    command("backends", _cmd_backends, "registered backends: availability and capabilities")

    listing = command("list", _cmd_list, "the case ids of a profile", "spec")
    listing.add_argument("-k", dest="patterns", action="append", default=[],
                         help="keep ids containing PATTERN (* and ? are wildcards)")

    running = command("run", _cmd_run, "run the checks; exit 1 on any unexpected failure",
                      "spec", "worker", "parallel")
    running.add_argument("--backend", action="append", default=[],
                         help="a registered name or module:Class (repeatable); "
                              "default: every available backend")
    running.add_argument("-k", dest="patterns", action="append", default=[],
                         help="keep case ids containing PATTERN (* and ? are wildcards)")
    running.add_argument("--case", action="append", default=[], help="exactly this case id")
    running.add_argument("--check", action="append", default=[],
                         help=f"check family (repeatable): {', '.join(CHECK_FAMILIES)}")
    running.add_argument("--report-json", type=Path, help="write the JSON report here")
    running.add_argument("--save-accuracy", type=Path, help="save per-check errors here")
    running.add_argument("--compare-accuracy", type=Path,
                         help="fail checks whose error grew past --drift-factor against "
                              "this saved baseline, even inside the budget")
    running.add_argument("--drift-factor", type=_factor, default=2.0,
                         help="how much an error may grow over the baseline (>= 1)")
    running.add_argument("--strict-manifest", action="store_true",
                         help="fail when a manifest entry matches nothing")
    running.add_argument("--junit-xml", type=Path, help="write a JUnit XML report here")
    running.add_argument("--summary-md", type=Path,
                         help="write a Markdown summary (for a CI job page) here")
    running.add_argument("--allow-empty", action="store_true",
                         help="do not fail when a backend claims no check of the run")
    running.add_argument("--durations", type=_count, default=0, metavar="N",
                         help="list the N slowest (backend, case) pairs after the matrix "
                              "(every case's time is in the JSON report's durations)")
    running.add_argument("--shard", metavar="K/N",
                         help="run share K of N of the cases (balanced by cost); join the "
                              "shards' JSON reports with `merge`")

    merging = command("merge", _cmd_merge, "join the JSON reports of `run --shard K/N` into "
                      "the report one run would have written")
    merging.add_argument("shards", nargs="+", type=Path, help="the shards' --report-json files")
    merging.add_argument("--report-json", type=Path, help="write the merged JSON report here")
    merging.add_argument("--junit-xml", type=Path, help="write a JUnit XML report here")
    merging.add_argument("--summary-md", type=Path, help="write a Markdown summary here")

    benching = command("bench", bench_command, "time backends' kernel calls on named shapes",
                       "worker")
    benching.add_argument("--backend", action="append", default=[], required=True,
                          help="a registered name or module:Class (repeatable)")
    benching.add_argument("--shapes", default="cpu", help="shape set: cpu or gpu (bench.toml)")
    benching.add_argument("--shape", action="append", default=[], help="only this shape")
    benching.add_argument("--rounds", type=_positive_int, default=3,
                          help="timed rounds per shape (each a median); their spread is shown")
    benching.add_argument("--report-json", type=Path, help="write the results here")

    exploring = command("explore", explore_command, "search the cases a backend claims for "
                        "failures (Hypothesis), shrink each to a spec entry", "worker")
    exploring.add_argument("--backend", required=True, help="a registered name or module:Class")
    exploring.add_argument("--max-examples", type=_positive_int, default=200)
    exploring.add_argument("--time-budget", type=_positive, metavar="SECONDS",
                           help="stop judging new examples after this long")
    exploring.add_argument("--seed", type=int, default=0, help="the same seed, the same draws")
    exploring.add_argument("--check", "--checks", dest="checks", action="extend", nargs="+",
                           default=[], metavar="FAMILY",
                           help=f"check family, repeatable, as in run (default all: "
                                f"{', '.join(CHECK_FAMILIES)}); --checks is its old spelling")
    exploring.add_argument("--save-spec", type=Path,
                           help="append each shrunk failure to this regression spec")
    exploring.add_argument("--report-json", type=Path, help="write the findings here")
    exploring.add_argument("--fp8", action="store_true",
                           help="draw only cases with an fp8 KV cache (the backend's kv_dtypes)")
    exploring.add_argument("--database", type=Path, default=None,
                           help="a folder that keeps each backend's findings: they are "
                                "replayed first next time, and kept while they fail (default: "
                                "none, nothing is written)")

    drawing = command("html", _cmd_html, "an HTML report with plots from saved JSON reports")
    drawing.add_argument("--report-json", type=Path, required=True)
    drawing.add_argument("--bench-json", type=Path, help="results of `bench --report-json`")
    drawing.add_argument("--out", type=Path, required=True)

    summarising = command("summary", _cmd_summary, "a Markdown table across backends from "
                          "saved JSON reports")
    summarising.add_argument("reports", nargs="+", metavar="REPORT[=MACHINE][@BACKEND,...]",
                             help="a --report-json file (.json or .json.gz), optionally with "
                                  "the machine to name it by and the backends to take from it")

    comparing = command("compare", _cmd_compare, "two saved reports of the same backends: "
                        "what newly fails (exit 1), newly passes, grew")
    comparing.add_argument("old", help="the report before (a --report-json file, .json[.gz])")
    comparing.add_argument("new", help="the report after")
    comparing.add_argument("--error-factor", type=_positive, default=2.0,
                           help="flag passing checks whose error grew more than this")
    comparing.add_argument("--allow-different-runs", action="store_true",
                           help="compare reports of other profiles, specs, backends or case "
                                "sets (refused by default: a mis-wired gate would pass)")

    building = command("build", build_command, "ahead-of-time build of a backend's kernels",
                       "spec")
    building.add_argument("what", choices=["tvm"], help="which kernels")
    building.add_argument("--target", choices=["cuda", "llvm"], default="cuda")
    building.add_argument("--bench-shapes", metavar="SET",
                          help="also the kernels of a bench shape set (cpu or gpu, bench.toml)")
    building.add_argument("--out", type=Path, required=True, help="directory to write")
    building.add_argument("--no-fatbin", action="store_true",
                          help="store CUDA source only (compiled by nvcc when loaded)")
    building.add_argument("--explore", type=_positive_int, metavar="N", default=0,
                          help="instead of a profile: N kernel shapes drawn as explore draws "
                               "them (GPU cost cap), each with and without a window, for "
                               "`explore` on a machine without TVM's compiler")
    building.add_argument("--seed", type=int, default=0, help="the draw's seed (--explore)")

    expectations = command("expectations", _cmd_expectations, "maintain expectation manifests",
                           "spec", "worker", "parallel")
    expectations.add_argument("action", choices=["update"],
                              help="update: run the profile and append an entry for each "
                                   "unexpected failure, with a placeholder reason to fill")
    expectations.add_argument("--backend", required=True)

    skeleton = command("new-backend", _cmd_new_backend, "write a skeleton adapter to fill in")
    skeleton.add_argument("name", help="backend name, e.g. my-kernel")
    skeleton.add_argument("--out", type=Path, help="file to write (default: NAME.py here)")
    return parser


def _cmd_backends(args: argparse.Namespace) -> int:
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


def _cmd_list(args: argparse.Namespace) -> int:
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


def _cmd_run(args: argparse.Namespace) -> int:
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


def _cmd_merge(args: argparse.Namespace) -> int:
    from conformance.shards import merge_reports

    _check_run_inputs(args)
    report = merge_reports(args.shards)
    write_terminal(report, sys.stdout)
    if not _write_reports(report, args):
        return 2
    return 0 if report.ok else 1


def _job_count(jobs: int) -> int:
    return jobs if jobs > 0 else (os.cpu_count() or 1)


def _cmd_html(args: argparse.Namespace) -> int:
    from conformance.html_report import write_html
    from conformance.summary import load_report

    check_output(args.out, "--out")
    report = load_report(args.report_json)
    bench = read_json(args.bench_json, "--bench-json") if args.bench_json else None
    write_html(report, args.out, bench)
    print(f"wrote {args.out}")
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from conformance.summary import markdown, parse_source

    print(markdown([parse_source(text) for text in args.reports]), end="")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
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


def _cmd_expectations(args: argparse.Namespace) -> int:
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


def _cmd_new_backend(args: argparse.Namespace) -> int:
    out = args.out or Path(f"{args.name.replace('-', '_')}.py")
    write_skeleton(args.name, out)
    print(f"wrote {out}; run it with: python -m conformance run --backend "
          f"{out}:{class_name(args.name)} --profile smoke --allow-empty")
    return 0


PROFILE_DEFAULTS = {"build": "full"}  # every other command: ci


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "profile", "") is None:
        args.profile = PROFILE_DEFAULTS.get(args.command, "ci")
    try:
        return args.handler(args)
    except BrokenPipeError:  # `list | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except (SpecError, UnknownBackendError, ManifestError, ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
