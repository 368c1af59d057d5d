"""What each ``python -m conformance`` command does, given its parsed arguments.

``conformance.cli`` builds the parsers and dispatches to a ``handle_*`` here; each returns the
exit status. One module per group of commands: ``run`` (run, merge, expectations),
``reports`` (html, summary, compare), ``listing`` (backends, list, new-backend), ``bench``,
``explore``, ``build``. What they share (settings from the options, loading backends, the
refusal of one that cannot run here) is this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from conformance.session import BackendRun, RunSettings, open_backends
from conformance.zygote import SWITCH_VARIABLE, zygotes


def settings_from(args: argparse.Namespace, **more) -> RunSettings:
    return RunSettings(profile=args.profile, spec_path=args.spec, manifest_dir=args.expectations,
                       isolated=not args.in_process, case_timeout=args.case_timeout, **more)


def loading(args: argparse.Namespace) -> dict:
    """How backends are loaded: in a worker within the case timeout, or here to debug."""
    return {"isolated": not args.in_process, "load_timeout": args.case_timeout or None}


def job_count(jobs: int) -> int:
    return jobs if jobs > 0 else (os.cpu_count() or 1)


def open_named(names: list[str], args: argparse.Namespace) -> list[BackendRun] | None:
    """The backends the user named, or None (each reason printed) when one cannot run here:
    a named backend that cannot run is an error, never a silent skip."""
    backends = open_backends(names, getattr(args, "expectations", None), **loading(args))
    unavailable = [b for b in backends if b.reason]
    for backend in unavailable:
        print(f"error: backend {backend.label!r} is unavailable here: {backend.reason}",
              file=sys.stderr)
    return None if unavailable else backends


def forking(args: argparse.Namespace) -> bool:
    """Whether a command's workers come from zygotes (isolated, and not switched off)."""
    return not args.in_process and os.environ.get(SWITCH_VARIABLE) != "0"


def loaded_once(targets: list[str], args: argparse.Namespace,
                env: dict[str, str] | None = None) -> contextlib.AbstractContextManager:
    """Each backend of the command loaded once, in a zygote its workers are forked from
    (``conformance.zygote``; ``env``: a ``-j`` pool's variables); nothing to do in process."""
    return zygotes(targets, env) if forking(args) else contextlib.nullcontext()
