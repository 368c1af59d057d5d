"""NumPy's BLAS on one thread in every process the CLI runs, set before NumPy loads.

OpenBLAS splits a long reduction (the oracle's ``P @ V`` over thousands of tokens) among its
threads, and the split changes the sum's last bits: on an H100 machine (16 cores) a `full`
run with one BLAS thread a process against one with sixteen gave 2544 of 10985 results other
errors or budgets (the same verdicts). One thread everywhere keeps a report the same however
the run is scheduled (``-j``, isolated or ``--in-process``) and on any core count; it also
ran the harness faster (docs/isolation.md). A variable the user set stands.
"""

from __future__ import annotations

import os

BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> dict[str, str]:
    """The variables to set, those the user left alone."""
    return {name: "1" for name in BLAS_VARIABLES if name not in os.environ}


os.environ.update(one_blas_thread())
