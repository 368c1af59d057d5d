"""The fault a kernel under development makes on a GPU: a Triton store out of bounds (an
illegal memory access, sticky for the CUDA context it happens in), and beside it the same
trigger raised as a plain Python error. ``benchmarks/gpu_session.sh device-fault`` runs both
and compares their verdicts: a lost device must cost what the Python error costs, no more.
"""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.backends import TritonSplitKV


def triggered(problem) -> bool:
    """Group sizes of 7 and 16: half of the ``ci`` group-sizes family."""
    return problem.num_qo_heads // problem.num_kv_heads in (7, 16)


@triton.jit
def _store_far(pointer, offset):
    tl.store(pointer + offset, 1.0)


class OutOfBoundsStore(TritonSplitKV):
    name = "gpu-out-of-bounds-store"

    def decode(self, problem, out, lse, *, num_splits=None):
        if triggered(problem):
            import torch

            scratch = torch.empty(16, device="cuda")
            _store_far[(1,)](scratch, 1 << 40)  # 4 TiB past a 64-byte allocation
            torch.cuda.synchronize()
        super().decode(problem, out, lse, num_splits=num_splits)


class RaisesOnTheSameCases(TritonSplitKV):
    name = "gpu-raises"

    def decode(self, problem, out, lse, *, num_splits=None):
        if triggered(problem):
            raise RuntimeError("index out of range in the kernel's launch grid")
        super().decode(problem, out, lse, num_splits=num_splits)
