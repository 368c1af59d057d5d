"""Add up the profiles a run wrote under ``CONFORMANCE_PROFILE=DIR``, per kind of process.

    CONFORMANCE_PROFILE=prof python -m conformance run --backend numpy -j 2
    python benchmarks/profile_report.py prof [--top 25] [--sort tottime]

For each role (harness, pool, worker: ``conformance.profiling``) the processes' statistics
summed, the functions that took the most time, and the waits named apart: a side that polls
or sleeps for the other is not working, so the time left after them is the work.
"""

from __future__ import annotations

import argparse
import io
import pstats
import sys
from pathlib import Path

from conformance.profiling import ROLES

# where a side waits for the other: built-ins named with these (the channel, the pool's
# pipes), and the polling loop's own functions (conformance.polling)
WAITING_BUILTINS = ("select", "poll", "sched_yield", "recvmsg", "recv_into", "recv_bytes",
                    "time.sleep")
POLLING = ("poll_readable", "readable", "spare_cpu")


def role_stats(folder: Path, role: str) -> tuple[pstats.Stats | None, int]:
    files = sorted(folder.glob(f"{role}-*.prof"))
    if not files:
        return None, 0
    return pstats.Stats(*map(str, files), stream=io.StringIO()), len(files)


def waited(stats: pstats.Stats) -> float:
    """Seconds spent in the wait functions themselves (their own time, summed)."""
    return sum(own for (path, _, name), (_, _, own, _, _) in stats.stats.items()
               if (path == "~" and any(w in name for w in WAITING_BUILTINS))
               or (path.endswith("polling.py") and name in POLLING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumtime"))
    args = parser.parse_args(argv)
    found = False
    for role in ROLES:
        stats, count = role_stats(args.folder, role)
        if stats is None:
            continue
        found = True
        total = stats.total_tt
        wait = waited(stats)
        print(f"== {role}: {count} process(es), {total:.1f} s profiled, {wait:.1f} s waiting, "
              f"{total - wait:.1f} s working")
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats(args.sort).print_stats(args.top)
        print(out.getvalue().split("\n\n", 1)[-1].rstrip() + "\n")
    if not found:
        print(f"error: no <role>-<pid>.prof files in {args.folder}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
