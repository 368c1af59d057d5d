"""A parallel run starts its largest cases first, and still reports in the spec's order."""

from __future__ import annotations

from conformance import parallel
from conformance.parallel import Pool, longest_first
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec
from conformance.verdict import CaseRecord


def echo(item: str) -> str:
    return item


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
