"""What a fresh backend worker costs before its first result, N of them side by side.

    python benchmarks/worker_start.py --backend triton-splitkv --workers 16 [--fork]
        [--late-context]

Each worker times its phases: loading the backend (its imports and constructor), making its
CUDA context, Triton's cache key (a hash of Triton's own files, once a process) and its first
decode of a small ``ci`` case (the kernels loaded from the compile cache). Spawned, each does
all of it, as a run's workers do; with ``--fork`` one parent loads the backend as a zygote
does (``conformance.zygote``: no CUDA) and workers forked from it do the rest (issue 22).
A Triton backend starts its CUDA context and Triton's key in threads when it is constructed
(``runtime.start_early``), so its "cuda" phase is what is left to wait for;
``--late-context`` turns that off (``CONFORMANCE_EARLY_CONTEXT=0``), for the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from conformance import blas_threads  # noqa: F401  (as the CLI: one BLAS thread, set first)

PHASES = ("load", "cuda", "triton_key", "first_decode", "second_decode")


def load(target: str):
    from conformance.backends.registry import resolve

    return resolve(target)()


def triton_key() -> None:
    from triton.runtime.cache import triton_key as key

    key()


def after_load(backend, started: float, clock: dict[str, float]) -> dict[str, float]:
    """The phases after the load, timed in this process; ``clock`` holds those before."""
    import torch

    from conformance.materialise import materialise
    from conformance.problem import poisoned_outputs
    from conformance.selection import select_cases
    from conformance.spec import default_spec

    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        clock[name] = now - mark
        mark = now
    if torch.cuda.is_available():  # else a CPU backend: no context to make
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    phase("cuda")
    triton_key()
    phase("triton_key")
    case = next(c for c in select_cases(default_spec(), "ci", ["basic"])
                if c.dtype == "float16")
    problem = materialise(case)
    mark = time.perf_counter()
    for name in ("first_decode", "second_decode"):
        out, lse = poisoned_outputs(problem, 0.0)
        backend.decode(problem, out, lse)
        phase(name)
    clock["total"] = time.perf_counter() - started
    return clock


def child(target: str) -> None:
    started = time.perf_counter()
    backend = load(target)
    clock = after_load(backend, started, {"load": time.perf_counter() - started})
    print(json.dumps(clock), flush=True)


def spawned(target: str, workers: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--child", target],
                              stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def forked(target: str, workers: int) -> tuple[float, list[dict]]:
    """The parent loads as a zygote does (``load_deepest``: the process that goes on may be a
    fork that kept more of the preload); each child constructs the backend ("load") and goes
    on."""
    from conformance.preload import load_deepest

    started = time.perf_counter()
    loaded = load_deepest(target)
    if loaded.refused:
        raise SystemExit(f"a zygote would not fork: {loaded.refused}")
    if loaded.partial:
        print(f"a zygote would fork after part of the preload: {loaded.partial}", flush=True)
    parent_load = time.perf_counter() - started
    readers = []
    for _ in range(workers):
        read, write = os.pipe()
        if os.fork() == 0:
            os.close(read)
            begun = time.perf_counter()
            backend = load(target)
            clock = after_load(backend, begun, {"load": time.perf_counter() - begun})
            os.write(write, json.dumps(clock).encode())
            os._exit(0)
        os.close(write)
        readers.append(read)
    results = []
    for read in readers:
        with os.fdopen(read) as stream:
            results.append(json.loads(stream.read()))
    for _ in readers:
        os.wait()
    return parent_load, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton-splitkv")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--fork", action="store_true")
    parser.add_argument("--late-context", action="store_true")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.late_context:
        os.environ["CONFORMANCE_EARLY_CONTEXT"] = "0"
    if not os.environ.get("WORKER_START_CACHES"):  # the run's caches, Python's own included:
        from conformance.caches import use_cache_dir  # set before this Python starts

        use_cache_dir(None)
        os.environ["WORKER_START_CACHES"] = "1"
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    started = time.perf_counter()
    if args.fork:
        parent, results = forked(args.backend, args.workers)
    else:
        parent, results = 0.0, spawned(args.backend, args.workers)
    wall = time.perf_counter() - started
    way = ("forked" if args.fork else "spawned") + (", late context" if args.late_context
                                                     else "")
    line = [f"{way} x{args.workers}: wall {wall:.2f} s (parent's load {parent:.2f} s)"]
    for name in (*PHASES, "total"):
        values = [r[name] for r in results]
        line.append(f"{name} median {statistics.median(values):.3f} max {max(values):.3f}")
    print("; ".join(line))


if __name__ == "__main__":
    main()
