"""``build tvm``: an ahead-of-time build of every TVM kernel a profile (and bench set) needs."""

from __future__ import annotations

import argparse
import sys
import time

from conformance.backends.registry import resolve
from conformance.backends.tvm.kernels import AOT_ENV_NAME, build, keys_for_case
from conformance.bench import select_shapes
from conformance.selection import select_cases
from conformance.session import RunSettings


def handle_build(args: argparse.Namespace) -> int:
    """``python -m conformance build tvm``: every kernel a profile (and bench set) needs."""
    backend = resolve("tvm-cuda" if args.target == "cuda" else "tvm-cpu")
    if args.explore:
        if args.patterns:
            print("error: -k narrows a profile's cases; --explore draws its own shapes",
                  file=sys.stderr)
            return 2
        from conformance.strategies import GPU_COST_CAP, draw_instances

        cases = draw_instances(backend.capabilities, args.explore, args.seed, GPU_COST_CAP)
        what = f"{len(cases)} kernel shapes drawn for explore (seed {args.seed})"
    else:
        settings = RunSettings(profile=args.profile, spec_path=args.spec)
        cases = select_cases(settings.spec(), args.profile, args.patterns)
        if args.bench_shapes:
            cases += [shape.case() for shape in select_shapes(args.bench_shapes)]
        cases = [c for c in cases if backend.capabilities.unsupported_reason(c) is None]
        what = f"{len(cases)} cases of profile {args.profile}"
    keys = sorted({k for c in cases
                   for k in keys_for_case(c, args.target, whole_instance=bool(args.explore))},
                  key=lambda k: k.filename)
    print(f"building {len(keys)} TVM kernels for {what} into {args.out}", flush=True)
    started = time.monotonic()
    summary = build(keys, args.out, fatbins=not args.no_fatbin)
    print(f"done in {time.monotonic() - started:.1f}s: compile {summary['compile_seconds']:.1f}s, "
          f"nvcc {summary['nvcc_seconds']:.1f}s; {len(summary['failures'])} kernels TVM could "
          f"not build (listed in manifest.json); run with {AOT_ENV_NAME}={args.out}")
    return 0
