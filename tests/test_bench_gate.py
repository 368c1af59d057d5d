"""The pytest-benchmark gate: a slowed backend fails --benchmark-compare-fail, the same one
unchanged passes. CPU shapes, gated on the minimum with a wide threshold: this test shares
two cores with the rest of the suite under xdist (an unchanged backend was measured 1.5x slower
there), and the planted slowdown is 10x."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tmp_path, backend, *args):
    # an xdist worker's variables would make pytest-benchmark disable itself in the child
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider",
         "--bench-backend", backend, f"--benchmark-storage={tmp_path}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_slowed_backend_fails_the_gate_and_the_unchanged_one_passes(tmp_path):
    saved = bench(tmp_path, "numpy", "--benchmark-save=baseline")
    assert saved.returncode == 0, saved.stdout[-2000:]
    gate = ("--benchmark-compare=0001", "--benchmark-compare-fail=min:200%")
    unchanged = bench(tmp_path, "numpy", *gate)
    assert unchanged.returncode == 0, unchanged.stdout[-2000:] + unchanged.stderr[-2000:]
    slowed = bench(tmp_path, "tests.planted:SlowedDown", *gate)
    assert slowed.returncode != 0
    assert "Performance has regressed" in slowed.stdout + slowed.stderr
