"""The verdicts of the NumPy backend's ``ci`` run, against the ones recorded in
``tests/data/numpy-ci-verdicts.txt.gz``: a harness change (a speed-up, a move) that loses a
check, adds one or turns a verdict is caught here, across commits.

Verdicts, not errors: float32 sums differ in their last bit between CPUs (NumPy picks its
SIMD kernels per machine), so errors are compared byte for byte only within one machine
(``tests/test_cli.py``: the same run scheduled two ways). After a change that is meant to
move verdicts (a new case, a new check), record them again:
``CONFORMANCE_RECORD_VERDICTS=1 python -m pytest tests/test_recorded_verdicts.py``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from tests.run_cli import cli

RECORDED = Path(__file__).with_name("data") / "numpy-ci-verdicts.txt.gz"


def verdicts(report: dict) -> list[str]:
    return [f"{r['case']}\t{r['check']}\t{r['status']}" for r in report["results"]]


def test_the_numpy_ci_verdicts_are_the_recorded_ones(tmp_path):
    path = tmp_path / "numpy-ci.json"
    result = cli("run", "--backend", "numpy", "--profile", "ci", "-j", "2", "--report-json",
                 path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    now = verdicts(json.loads(path.read_text()))
    if os.environ.get("CONFORMANCE_RECORD_VERDICTS"):
        RECORDED.write_bytes(gzip.compress(("\n".join(now) + "\n").encode(), mtime=0))
    recorded = gzip.decompress(RECORDED.read_bytes()).decode().splitlines()
    lost, gained = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
    assert not lost and not gained, (
        f"{len(lost)} recorded verdicts gone, {len(gained)} new; first gone: {lost[:3]}, "
        f"first new: {gained[:3]} (record again if meant: see this module's docstring)")
    assert now == recorded  # and in the same order
