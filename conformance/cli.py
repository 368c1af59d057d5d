"""``python -m conformance``: list backends and cases, run the suite, search, compare, report.

Each subcommand is a parser built from shared parents (the spec, the worker, parallel runs)
and a handler from ``conformance.commands`` set with ``set_defaults``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from conformance import blas_threads  # noqa: F401  (first: before NumPy loads)
from conformance.backends.registry import UnknownBackendError
from conformance.caches import use_cache_dir
from conformance.checks import CHECK_FAMILIES
from conformance.commands.listing import handle_backends, handle_list, handle_new_backend
from conformance.commands.reports import handle_compare, handle_html, handle_summary
from conformance.commands.run import handle_expectations, handle_merge, handle_run
from conformance.manifest import ManifestError
from conformance.profiling import profiled
from conformance.session import DEFAULT_CASE_TIMEOUT, MAX_SECONDS
from conformance.spec import DEFAULT_MAX_CASE_MIB, SpecError


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
    worker.add_argument("--cache-dir", type=Path,
                        help="where Triton, Inductor and FlashInfer keep compiled kernels "
                             "(default: ~/.cache/paged-decode-conformance, unless their own "
                             "variables are set)")
    parallel = argparse.ArgumentParser(add_help=False)
    parallel.add_argument("-j", "--jobs", type=_jobs, default=1,
                          help="cases in parallel (0: one per CPU core)")
    parallel.add_argument("--max-case-mib", type=_positive, default=DEFAULT_MAX_CASE_MIB,
                          help=f"refuse cases whose arrays would be larger (default "
                               f"{DEFAULT_MAX_CASE_MIB})")
    patterns = argparse.ArgumentParser(add_help=False)
    patterns.add_argument("-k", dest="patterns", action="append", default=[],
                          help="keep case ids containing PATTERN (* and ? are wildcards; "
                               "repeated: all of them)")
    return {"spec": spec, "worker": worker, "parallel": parallel, "patterns": patterns}


def _parser() -> argparse.ArgumentParser:
    from conformance.commands.bench import handle_bench
    from conformance.commands.build import handle_build
    from conformance.commands.explore import handle_explore

    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parents = _parents()

    def command(name: str, handler: Callable[[argparse.Namespace], int], help: str,
                *uses: str) -> argparse.ArgumentParser:
        made = sub.add_parser(name, help=help, parents=[parents[use] for use in uses])
        made.set_defaults(handler=handler)
        return made

    command("backends", handle_backends, "registered backends: availability and capabilities")

    command("list", handle_list, "the case ids of a profile", "spec", "patterns")

    running = command("run", handle_run, "run the checks; exit 1 on any unexpected failure",
                      "spec", "worker", "parallel", "patterns")
    running.add_argument("--backend", action="append", default=[],
                         help="a registered name or module:Class (repeatable); "
                              "default: every available backend")
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

    merging = command("merge", handle_merge, "join the JSON reports of `run --shard K/N` into "
                      "the report one run would have written")
    merging.add_argument("shards", nargs="+", type=Path, help="the shards' --report-json files")
    merging.add_argument("--report-json", type=Path, help="write the merged JSON report here")
    merging.add_argument("--junit-xml", type=Path, help="write a JUnit XML report here")
    merging.add_argument("--summary-md", type=Path, help="write a Markdown summary here")

    benching = command("bench", handle_bench, "time backends' kernel calls on named shapes",
                       "worker")
    benching.add_argument("--backend", action="append", default=[], required=True,
                          help="a registered name or module:Class (repeatable)")
    benching.add_argument("--shapes", default="cpu", help="shape set: cpu or gpu (bench.toml)")
    benching.add_argument("--shape", action="append", default=[], help="only this shape")
    benching.add_argument("--rounds", type=_positive_int, default=3,
                          help="timed rounds per shape (each a median); their spread is shown")
    benching.add_argument("--report-json", type=Path, help="write the results here")

    exploring = command("explore", handle_explore, "search the cases a backend claims for "
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

    drawing = command("html", handle_html, "an HTML report with plots from saved JSON reports")
    drawing.add_argument("--report-json", type=Path, required=True)
    drawing.add_argument("--bench-json", type=Path, help="results of `bench --report-json`")
    drawing.add_argument("--out", type=Path, required=True)

    summarising = command("summary", handle_summary, "a Markdown table across backends from "
                          "saved JSON reports")
    summarising.add_argument("reports", nargs="+", metavar="REPORT[=MACHINE][@BACKEND,...]",
                             help="a --report-json file (.json or .json.gz), optionally with "
                                  "the machine to name it by and the backends to take from it")

    comparing = command("compare", handle_compare, "two saved reports of the same backends: "
                        "what newly fails (exit 1), newly passes, grew")
    comparing.add_argument("old", help="the report before (a --report-json file, .json[.gz])")
    comparing.add_argument("new", help="the report after")
    comparing.add_argument("--error-factor", type=_positive, default=2.0,
                           help="flag passing checks whose error grew more than this")
    comparing.add_argument("--allow-different-runs", action="store_true",
                           help="compare reports of other profiles, specs, backends or case "
                                "sets (refused by default: a mis-wired gate would pass)")

    building = command("build", handle_build, "ahead-of-time build of a backend's kernels",
                       "spec", "patterns")
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

    expectations = command("expectations", handle_expectations, "maintain expectation manifests",
                           "spec", "worker", "parallel")
    expectations.add_argument("action", choices=["update"],
                              help="update: run the profile and append an entry for each "
                                   "unexpected failure, with a placeholder reason to fill")
    expectations.add_argument("--backend", required=True)

    skeleton = command("new-backend", handle_new_backend, "write a skeleton adapter to fill in")
    skeleton.add_argument("name", help="backend name, e.g. my-kernel")
    skeleton.add_argument("--out", type=Path, help="file to write (default: NAME.py here)")
    return parser



PROFILE_DEFAULTS = {"build": "full"}  # every other command: ci


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "profile", "") is None:
        args.profile = PROFILE_DEFAULTS.get(args.command, "ci")
    try:
        if hasattr(args, "cache_dir"):  # a command that loads backends
            use_cache_dir(args.cache_dir)
        with profiled("harness"):
            return args.handler(args)
    except BrokenPipeError:  # `list | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except (SpecError, UnknownBackendError, ManifestError, ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
