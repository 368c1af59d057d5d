"""What a fresh pinned buffer per upload and per download costs, N processes side by side.

    python benchmarks/pinned_staging.py --workers 16 --calls 2000 --kib 64

``backends.tensors`` stages each call's small arrays in a pinned buffer made for the call
(``torch.empty(..., pin_memory=True)``) and reads the outputs back through another. A
profile of a warm ``ci`` run put ``torch.empty`` at a fifth of the workers' time (issue 22).
Each process here does what one decode call does to the bus, ``--calls`` times: stage,
upload without waiting, a small kernel, download into pinned memory, one wait; once with
fresh pinned buffers (as the adapters do) and once reusing two made beforehand, which is
safe here because every call ends in that wait. Prints the median microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one_process(calls: int, kib: int, reuse: bool) -> float:
    import numpy as np
    import torch

    data = np.ones(kib * 1024, dtype=np.uint8)
    kept = (torch.empty(data.size, dtype=torch.uint8, pin_memory=True),
            torch.empty(data.size, dtype=torch.uint8, pin_memory=True))
    stream = torch.cuda.current_stream()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        staged = kept[0] if reuse else torch.empty(data.size, dtype=torch.uint8, pin_memory=True)
        staged.numpy()[:] = data
        moved = staged.to("cuda", non_blocking=True)
        result = moved + 1
        host = kept[1] if reuse else torch.empty(data.size, dtype=torch.uint8, pin_memory=True)
        host.copy_(result, non_blocking=True)
        stream.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[calls // 10:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--child", choices=("fresh", "reused"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args.calls, args.kib, args.child == "reused")))
        return
    for mode in ("fresh", "reused", "fresh", "reused"):
        children = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--calls",
                                      str(args.calls), "--kib", str(args.kib)],
                                     stdout=subprocess.PIPE, text=True)
                    for _ in range(args.workers)]
        medians = [json.loads(child.communicate()[0]) for child in children]
        print(f"{mode} x{args.workers}, {args.kib} KiB: median of the processes' medians "
              f"{statistics.median(medians):.0f} us per call (max {max(medians):.0f})")


if __name__ == "__main__":
    main()
