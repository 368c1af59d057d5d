"""``CONFORMANCE_PROFILE=DIR``: every process of a run profiles itself, and the report adds
them up per kind of process."""

from __future__ import annotations

import os
import pstats
import subprocess
import sys

from tests.run_cli import ROOT, cli

CASE = "basic/q8kv2-d64-ps16-f32/ctx[37,5,80]-normal"
OTHER = "basic/q8kv2-d64-ps16-f16/ctx[37,5,80]-normal"  # two cases: -j 2 starts a pool


def test_each_process_of_a_run_writes_its_profile_and_the_report_sums_them(tmp_path):
    folder = tmp_path / "prof"
    env = {**os.environ, "CONFORMANCE_PROFILE": str(folder)}
    ran = cli("run", "--backend", "numpy", "--case", CASE, "--case", OTHER, "-j", "2",
              env=env)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    roles = {path.name.split("-")[0] for path in folder.glob("*.prof")}
    assert roles == {"harness", "pool", "worker"}, sorted(folder.iterdir())
    worker = pstats.Stats(*map(str, folder.glob("worker-*.prof")))
    decodes = [key for key in worker.stats if key[0].endswith("numpy_splitk.py")
               and key[2] == "decode"]
    assert decodes, "the backend's decode is not in the workers' profiles"
    report = subprocess.run([sys.executable, "benchmarks/profile_report.py", str(folder)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for role in ("harness", "pool", "worker"):
        assert f"== {role}: " in report.stdout


def test_without_the_variable_no_profile_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CONFORMANCE_PROFILE"}
    ran = cli("run", "--backend", "numpy", "--case", CASE, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert not list(tmp_path.rglob("*.prof"))
