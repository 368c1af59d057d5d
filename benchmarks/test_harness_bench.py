"""Time the suite itself: a whole run of the NumPy backend, isolated and in-process.

    pytest benchmarks/test_harness_bench.py --harness-profile ci --benchmark-save=harness
    pytest benchmarks/test_harness_bench.py --harness-profile ci \\
        --benchmark-compare=0003 --benchmark-compare-fail=min:25%

The kernel is NumPy's, so what is timed is the harness's own work: drawing and laying out
each problem, the float64 oracle, the checks, and (isolated) the worker and its channel.
Issue 22's figures are ratios: the isolated run over the in-process one (at most 1.15x), and
a build against an earlier one (`--benchmark-compare`).
"""

from __future__ import annotations

import pytest

from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "in-process"])
def test_run(benchmark, request, isolated):
    if benchmark.disabled:
        pytest.skip("benchmarks are disabled (--benchmark-disable, or under xdist)")
    profile = request.config.getoption("harness_profile")
    cases = select_cases(default_spec(), profile)
    settings = RunSettings(profile=profile, isolated=isolated)

    def one_run():
        backend = open_backend("numpy", isolated=isolated)  # run() disconnects it
        return run([backend], cases, settings)

    report = benchmark.pedantic(one_run, rounds=3, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"profile": profile, "cases": len(cases),
                                 "checks": len(report.results)})
    assert report.ok, [(r.case, r.check, r.message) for r in report.failures][:3]
