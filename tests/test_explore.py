"""Explore finds what no listed case catches, shrinks it to the smallest case, and invents
nothing on correct backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from conformance.explore import explore
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec
from conformance.strategies import is_power_of_two
from tests.planted import SHAPE_ONLY
from tests.run_cli import ROOT, cli

TRIGGERS = {
    "page_size": lambda case: not is_power_of_two(case.page_size),
    "head_dim": lambda case: case.head_dim % 32 != 0,
    "num_kv_heads": lambda case: case.num_kv_heads > 1 and case.num_kv_heads % 2 == 1,
}


def run_explore(name: str, examples: int, seed: int = 0, **options):
    backend = open_backend(name)
    try:
        return explore(backend, RunSettings(profile="explore"), examples, seed=seed,
                       database=None, **options)
    finally:
        backend.disconnect()


@pytest.mark.parametrize("bug,field,value", SHAPE_ONLY, ids=[b.__name__ for b, _, _ in SHAPE_ONLY])
def test_no_listed_case_has_the_shape_that_triggers_a_shape_only_bug(bug, field, value):
    spec = default_spec()
    listed = [c for profile in ("ci", "full") for c in spec.cases(profile)]
    assert listed and not [c.id for c in listed if TRIGGERS[field](c)]


@pytest.mark.parametrize("bug,field,value", SHAPE_ONLY, ids=[b.__name__ for b, _, _ in SHAPE_ONLY])
def test_explore_finds_each_shape_only_bug_and_shrinks_it(bug, field, value):
    # Whichever check a case fails first names its finding: a smaller case of the same bug
    # may land under poison or merge rather than oracle, so the smallest of all is judged.
    state = run_explore(f"tests.planted:{bug.__name__}", 300)
    assert any(check.startswith("oracle/") for check in state.findings), \
        f"{bug.__name__}: oracle found nothing in {state.examples} examples"
    smallest = min((f.case for f in state.findings.values()),
                   key=lambda c: (getattr(c, field), c.batch))
    assert getattr(smallest, field) == value, smallest.id
    assert smallest.batch == 1 and sum(smallest.context_lens) <= 4, smallest.id


@pytest.mark.parametrize("backend", ["numpy", "tests.planted:Float64Reference"])
def test_correct_backends_give_explore_nothing_to_report(backend):
    state = run_explore(backend, 250, seed=7)
    assert state.examples >= 200
    assert not state.findings, {c: f.case.id + ": " + f.result.message
                                for c, f in state.findings.items()}


FOUND_BY_EXPLORE = """schema = 1
[profiles.found]
doc = "cases explore drew that a correct kernel failed"
[[family]]
name = "explore"
doc = "scores of ~-1e5 at head_dim 16, each moved ~12 spacings by its dot product's sum"
profiles = ["found"]
[family.set]
num_qo_heads = 1
num_kv_heads = 1
head_dim = 16
page_size = 44
context_lens = [235, 1, 347]
distribution = "very-negative"
dtypes = ["float32"]
"""


def test_the_case_explore_found_failing_a_correct_kernel_passes(tmp_path):
    spec = tmp_path / "found.toml"
    spec.write_text(FOUND_BY_EXPLORE)
    result = cli("run", "--backend", "numpy", "--spec", spec, "--profile", "found")
    assert result.returncode == 0, result.stdout[-2000:]


# The standing no-false-positive search: a few hundred examples here, thousands with
# CONFORMANCE_EXPLORE_EXAMPLES (docs/explore.md has the last long run's figures).
STANDING = int(os.environ.get("CONFORMANCE_EXPLORE_EXAMPLES", "100"))


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_explore_finds_nothing_on_the_numpy_backend(seed):
    state = run_explore("numpy", STANDING, seed=seed)
    assert state.examples >= STANDING * 0.8
    assert not state.findings, {c: f.case.id + ": " + f.result.message
                                for c, f in state.findings.items()}


def test_explore_counts_what_it_judged_by_kind_and_variant():
    seen: list = []
    state = run_explore("numpy", 40, seed=5, observe=seen.append)
    kinds = Counter(case.kind for case in seen)
    assert state.judged["gqa"] + state.judged["mla"] == len(seen) == state.examples
    assert state.judged["mla"] == kinds["mla"] > 0
    assert state.judged["multi_token"] == sum(case.query_lens is not None for case in seen) > 0


def test_the_same_seed_draws_the_same_examples():
    drawn: list[list[str]] = [[], []]
    for run in drawn:
        run_explore("numpy", 15, seed=3, observe=lambda case, run=run: run.append(case.id))
    assert drawn[0] == drawn[1] and len(set(drawn[0])) > 5
    other: list[str] = []
    run_explore("numpy", 15, seed=4, observe=lambda case: other.append(case.id))
    assert other != drawn[0]


def test_a_saved_regression_spec_replays_the_failure_through_run(tmp_path):
    spec, report = tmp_path / "regressions.toml", tmp_path / "explore.json"
    found = cli("explore", "--backend", "tests.planted:OddKvHeadRemainder", "--max-examples",
                "150", "--check", "oracle", "--save-spec", spec, "--report-json", report,
                "--database", tmp_path / "db")
    assert found.returncode == 1, found.stdout[-2000:] + found.stderr[-2000:]
    assert "[[family]]" in found.stdout and "rerun: python -m conformance run" in found.stdout
    findings = json.loads(report.read_text())["findings"]
    assert findings and all(f["check"].startswith("oracle/") for f in findings)
    replay = cli("run", "--backend", "tests.planted:OddKvHeadRemainder", "--spec", spec,
                 "--profile", "regressions", "--check", "oracle")
    assert replay.returncode == 1 and "FAILED bug-odd-kv-head-remainder oracle/" in replay.stdout
    clean = cli("run", "--backend", "numpy", "--spec", spec, "--profile", "regressions")
    assert clean.returncode == 0, clean.stdout[-2000:]


def test_saved_findings_of_a_bug_the_values_trigger_replay_every_one(tmp_path):
    spec, report = tmp_path / "regressions.toml", tmp_path / "explore.json"
    found = cli("explore", "--backend", "tests.planted:DropsTokenOnPositiveKey",
                "--max-examples", "200", "--check", "oracle", "--save-spec", spec,
                "--report-json", report)
    assert found.returncode == 1, found.stdout[-2000:] + found.stderr[-2000:]
    findings = json.loads(report.read_text())["findings"]
    assert findings and "seed = " in spec.read_text()
    replay = cli("run", "--backend", "tests.planted:DropsTokenOnPositiveKey", "--spec", spec,
                 "--profile", "regressions", "--check", "oracle", "--report-json",
                 tmp_path / "replay.json")
    failed = {(r["case"].split("/")[0], r["check"]) for r in json.loads(
        (tmp_path / "replay.json").read_text())["results"] if r["status"] == "failed"}
    wanted = {(f"explore-bug-data-dependent-{f['check'].replace('/', '-')}-{n}", f["check"])
              for n, f in enumerate(findings, start=1)}
    assert wanted <= failed, (wanted, failed, replay.stdout[-2000:])


def test_a_database_replays_earlier_findings_first_and_nothing_lands_in_the_current_folder(
        tmp_path):
    db, here = tmp_path / "db", tmp_path / "here"
    here.mkdir()
    args = ("explore", "--backend", f"{ROOT / 'tests' / 'planted.py'}:OddKvHeadRemainder",
            "--check", "oracle", "--database", db)
    first = cli(*args, "--max-examples", "150", cwd=here)
    assert first.returncode == 1, first.stdout[-2000:] + first.stderr[-2000:]
    saved = db / "bug-odd-kv-head-remainder.toml"
    assert "num_kv_heads = 3" in saved.read_text() or "num_kv_heads = 5" in saved.read_text()
    # one example drawn: the failure comes from the replay, and says so
    again = cli(*args, "--max-examples", "1", cwd=here)
    assert again.returncode == 1, again.stdout[-2000:]
    count = saved.read_text().count("[[family]]")
    assert f"replayed {count} saved finding(s) from {saved} first: {count} still fail" in \
        again.stdout
    fixed = cli("explore", "--backend", "numpy", "--check", "oracle", "--database", db,
                "--max-examples", "1", cwd=here)
    assert fixed.returncode == 0  # another backend's findings are its own
    assert list(here.iterdir()) == []  # no .hypothesis/ where the user stands


def test_explore_refuses_bad_input_with_exit_2(tmp_path):
    result = cli("explore", "--backend", "numpy", "--max-examples", "0")
    assert result.returncode == 2
    assert "--max-examples: must be a positive integer, got 0" in result.stderr
    result = cli("explore", "--backend", "numpy", "--save-spec", tmp_path / "no" / "x.toml")
    assert result.returncode == 2 and "does not exist" in result.stderr
    same = tmp_path / "x.out"  # one file for both outputs: the second would overwrite it
    result = cli("explore", "--backend", "numpy", "--save-spec", same, "--report-json", same)
    assert result.returncode == 2 and "the same file as --save-spec" in result.stderr


def test_a_backend_with_kernel_instances_is_explored_inside_them_and_shrunk_there():
    backend = open_backend("tests.planted:InstancedOddKvHeads")
    instances = backend.capabilities.instances
    drawn: list = []
    try:
        state = explore(backend, RunSettings(profile="explore"), 150, database=None,
                        observe=drawn.append)
    finally:
        backend.disconnect()
    assert drawn and all((c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size, c.dtype)
                         in instances for c in drawn)
    oracle = [f.case for check, f in state.findings.items() if check.startswith("oracle/")]
    assert oracle, f"nothing found in {state.examples} examples"
    assert min(c.num_kv_heads for c in oracle) == 5


class ExampleClock:
    """A clock that advances one "second" per example judged: the time budget's logic,
    tested whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, case) -> None:
        self.now += 1.0


def test_the_time_budget_ends_the_search_however_many_examples_are_allowed():
    clock = ExampleClock()
    state = run_explore("numpy", 100_000, time_budget=40.0, clock=clock, observe=clock.tick)
    assert state.stopped_early and state.examples == 41, state.examples


def test_a_failure_found_before_the_time_budget_is_spent_is_kept():
    clock = ExampleClock()
    # found at once, then shrunk until the budget ends the shrinking: the finding stands
    state = run_explore("tests.planted:Base2Lse", 100_000, time_budget=20.0, clock=clock,
                        observe=clock.tick)
    assert state.stopped_early and state.examples == 21, state.examples
    assert "oracle/lse" in state.findings, sorted(state.findings)


def test_an_interrupted_search_keeps_what_it_found():
    # a timeout's TERM (or Ctrl-C) arrives as KeyboardInterrupt in the middle of a search
    drawn = []

    def interrupt_at_the_twentieth(case):
        drawn.append(case)
        if len(drawn) == 20:
            raise KeyboardInterrupt

    state = run_explore("tests.planted:Base2Lse", 100_000, observe=interrupt_at_the_twentieth)
    assert state.interrupted and state.examples == 20, state.examples
    assert "oracle/lse" in state.findings, sorted(state.findings)


def test_explore_goes_on_searching_past_the_first_failure():
    state = run_explore("tests.planted:TwoShapeOnlyBugs", 400)
    families = {check.split("/")[0] for check in state.findings}
    assert {"oracle", "purity"} <= families, (state.rounds, sorted(state.findings))
    assert state.rounds > 1


def test_failures_a_manifest_lists_are_not_reported_as_found(tmp_path):
    from conformance.checks import CHECK_FAMILIES

    (tmp_path / "bug-odd-kv-head-remainder.toml").write_text("".join(
        f'[[expect]]\ncase = "explore/*"\ncheck = "{family}"\nreason = "known"\n'
        for family in CHECK_FAMILIES))
    backend = open_backend("tests.planted:OddKvHeadRemainder", tmp_path)
    try:
        state = explore(backend, RunSettings(profile="explore", manifest_dir=tmp_path), 150,
                        database=None)
    finally:
        backend.disconnect()
    assert state.examples == 150 and not state.findings, sorted(state.findings)


def wide_regime_counts() -> dict[str, int]:
    """How often 600 examples of seed 1 draw each wide regime for the NumPy backend."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed

    from conformance.backends.numpy_splitk import NumpySplitK
    from conformance.strategies import WIDE_COST, cases, cost

    seen: dict[str, int] = dict.fromkeys(
        ("long context", "wide pool", "wide window with sinks", "splits x scores",
         "very-negative in 16 bits"), 0)

    @hyp_seed(1)
    @settings(max_examples=600, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(NumpySplitK.capabilities))
    def draw(case):
        long = max(case.context_lens) > 32767
        seen["long context"] += long
        seen["wide pool"] += case.pool_pages > 32767
        seen["wide window with sinks"] += bool(
            case.window and case.window > 64 and case.sinks
            and max(case.context_lens) > case.window + case.sinks)
        seen["splits x scores"] += bool(case.num_splits and case.distribution in (
            "very-negative", "large"))
        seen["very-negative in 16 bits"] += (case.distribution == "very-negative"
                                             and case.dtype != "float32")
        if long or case.pool_pages:
            assert case.num_kv_heads == 1 and case.num_qo_heads <= 2 and case.head_dim <= 32
            assert cost(case) <= WIDE_COST

    draw()
    return seen


def test_explore_draws_the_wide_regimes_with_tiny_heads():
    """Issue 17: contexts past int16/uint16, pools past 32767 pages, windows past 64 with
    sinks, split counts with very negative or large scores, very-negative in 16 bits. Drawn
    in a fresh interpreter: Hypothesis also draws constants from the modules loaded, so in
    a worker that ran other tests seed 1 draws other cases (there, 2 wide windows of 600)."""
    result = subprocess.run(
        [sys.executable, "-c", "import json; from tests.test_explore import "
                               "wide_regime_counts; print(json.dumps(wide_regime_counts()))"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert all(count >= 5 for count in seen.values()), "; ".join(
        f"{regime}: {count}" for regime, count in seen.items())


def test_explore_without_hypothesis_says_which_extra_in_one_line():
    import subprocess
    import sys

    blocked = ("import sys; sys.modules['hypothesis'] = None; from conformance.cli import main; "
               "sys.exit(main(['explore', '--backend', 'numpy', '--time-budget', '1']))")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: explore searches with Hypothesis, which is not installed here: pip install "
        "'paged-decode-conformance[explore]'"]
