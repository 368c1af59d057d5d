"""``backends``, ``list`` and ``new-backend``: what is registered, what a profile holds, and
the skeleton of a new adapter."""

from __future__ import annotations

import argparse
from pathlib import Path

from conformance.backends.registry import known_backends
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backends
from conformance.skeleton import class_name, write_skeleton


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


def handle_new_backend(args: argparse.Namespace) -> int:
    out = args.out or Path(f"{args.name.replace('-', '_')}.py")
    write_skeleton(args.name, out)
    print(f"wrote {out}; run it with: python -m conformance run --backend "
          f"{out}:{class_name(args.name)} --profile smoke --allow-empty")
    return 0
