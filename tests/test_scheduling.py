"""How a parallel run shares the machine: its largest cases first (reported in the spec's
order all the same), each job's libraries a share of the cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conformance import parallel
from conformance.blas_threads import BLAS_VARIABLES
from conformance.checks import oracle
from conformance.checks.shared import SHARED
from conformance.parallel import THREAD_VARIABLES, Pool, longest_first, thread_environment
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec
from conformance.verdict import CaseRecord


def echo(item: str) -> str:
    return item


def environment_at_start(name: str) -> str | None:
    """``name`` as this process's environment held it when it started: what a library
    loaded while a spawned worker unpickles its arguments saw."""
    with open("/proc/self/environ", "rb") as environ:
        found = dict(entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry)
    value = found.get(name.encode())
    return value.decode() if value is not None else None


def test_the_pool_sends_items_in_the_order_asked_and_reports_their_own_indices():
    heard: list[tuple[int, str]] = []
    pool = Pool(echo, 1)  # one worker: the order it hears them in is the order they went out
    try:
        pool.run(["a", "b", "c"], lambda i, result: heard.append((i, result)),
                 lambda i, code: None, order=[2, 0, 1])
    finally:
        pool.close()
    assert heard == [(2, "c"), (0, "a"), (1, "b")]


def test_longest_first_keeps_the_order_of_equal_costs_and_of_groups():
    assert longest_first([1, 5, 3, 5, 0]) == [1, 3, 2, 0, 4]
    assert longest_first([1, 5, 3, 5, 0], groups=[0, 0, 0, 1, 1]) == [1, 2, 0, 3, 4]
    assert longest_first([]) == []


def test_a_parallel_run_hands_out_each_backends_largest_case_first_in_spec_order(
        monkeypatch, tmp_path):
    """Backend by backend (a worker that changes backend closes the one it held), each
    backend's largest case first; the report in the spec's order."""
    cases = [*select_cases(default_spec(), "ci", ["basic/"])[:3],
             *select_cases(default_spec(), "ci", ["long-context/"])[:1]]
    largest = max(range(len(cases)), key=lambda i: cases[i].problem_bytes)
    assert largest != 0, "the test needs the largest case later than first in spec order"
    sent: list[int] = []

    def fake_pool(items, work, jobs, on_done, on_crash, pool=None, order=None):
        sent.extend(order if order is not None else range(len(items)))
        for index in sent:  # answer in the order they went out
            on_done(index, CaseRecord([], seconds=1.0))

    monkeypatch.setattr(parallel, "run_pool", fake_pool)
    settings = RunSettings(profile="ci", families=("oracle",), manifest_dir=tmp_path)
    backends = [open_backend("numpy", tmp_path), open_backend("tests.planted:Base2Lse", tmp_path)]
    report = run(backends, cases, settings, jobs=2)
    count = len(cases)
    assert sent[0] == largest and sent[count] == count + largest
    assert sorted(sent[:count]) == list(range(count))
    assert list(report.durations) == [(b.label, case.id) for b in backends for case in cases]


def test_each_job_gets_a_share_of_the_cores_and_one_blas_thread_unless_the_user_chose(
        monkeypatch):
    for name in (*THREAD_VARIABLES, *BLAS_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert thread_environment(1) == {"OMP_NUM_THREADS": str(parallel.CPUS),
                                     "TVM_NUM_THREADS": str(parallel.CPUS),
                                     "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert set(thread_environment(10 ** 6).values()) == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert "OMP_NUM_THREADS" not in thread_environment(1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/environ")
def test_a_pool_worker_starts_with_its_thread_share_and_the_harness_keeps_its_own(
        monkeypatch):
    names = (*THREAD_VARIABLES, *BLAS_VARIABLES)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # the user's choice stands
    jobs = 2 * parallel.CPUS  # a share of less than a core: one thread each
    heard: list[tuple[int, str | None]] = []
    pool = Pool(environment_at_start, jobs)
    try:
        pool.run(list(names), lambda i, value: heard.append((i, value)), lambda i, code: None)
    finally:
        pool.close()
    assert {names[i]: value for i, value in heard} == {
        "OMP_NUM_THREADS": "1", "TVM_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "3"}
    assert "OPENBLAS_NUM_THREADS" not in os.environ and os.environ["MKL_NUM_THREADS"] == "3"


def test_the_cli_sets_one_blas_thread_before_numpy_loads():
    watch = ("import os, sys\n"
             "class Watch:\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name == 'numpy':\n"
             "            print('numpy loads with', os.environ.get('OPENBLAS_NUM_THREADS'))\n"
             "            sys.meta_path.remove(self)\n"
             "sys.meta_path.insert(0, Watch())\n"
             "import conformance.cli\n")
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    done = subprocess.run([sys.executable, "-c", watch], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "numpy loads with 1", done.stdout + done.stderr


def test_a_large_cases_expected_values_computed_side_by_side_are_those_computed_in_turn(
        monkeypatch, tmp_path):
    """The oracles, score bound and unquantized answer of a case on threads (``side_by_side``,
    from ``SIDE_BY_SIDE_BYTES``; forced here on small cases) give every result as before."""
    cases = [*select_cases(default_spec(), "ci", ["fp8-"])[::9][:3],
             *select_cases(default_spec(), "ci", ["sink-logits/"])[:1]]
    submitted = []
    executor = oracle._executor()
    monkeypatch.setattr(oracle, "_executor", lambda: submitted.append(1) or executor)
    settings = RunSettings(profile="ci", manifest_dir=tmp_path)
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(oracle, "SIDE_BY_SIDE_BYTES", threshold)
        SHARED.entries.clear()  # nothing kept from the run before
        results.append(run([open_backend("numpy", tmp_path)], cases, settings).results)
    assert len(submitted) >= 4 * len(cases) and any(c.kv_dtype for c in cases)
    assert results[0] == results[1] and len(results[0]) > 20 * len(cases)
