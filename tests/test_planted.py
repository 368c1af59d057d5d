"""The suite catches every planted bug with the check meant for it, and passes the NumPy backend."""

import pytest

from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import DEFAULT_MAX_CASE_MIB, default_spec
from tests.planted import PLANTED, Base2WithSentinel, SentinelNotConverted

CI_CASES = select_cases(default_spec(), "ci")
FAMILY_OF = {case.id: case.family for case in CI_CASES}


@pytest.fixture(scope="module")
def numpy_report():
    return run([open_backend("numpy")], CI_CASES, RunSettings(profile="ci"))


# Sub-checks no planted bug proves, each with the reason (empty: every one is proven).
EXEMPT: dict[str, str] = {}


def test_every_sub_check_the_suite_emits_is_proven_by_a_planted_bug(numpy_report):
    emitted = {r.check for r in numpy_report.results}
    proven = {check for _, check in PLANTED}  # by full name: a prefix proves nothing
    unproven = sorted(emitted - proven - set(EXEMPT))
    assert not unproven, f"sub-checks no planted bug proves: {unproven}"
    assert proven <= emitted, f"planted checks the suite no longer emits: {proven - emitted}"
    assert set(EXEMPT) <= emitted, "an exemption names a sub-check the suite no longer emits"


def test_a_backend_in_tvm_conventions_passes_and_a_mistake_in_them_fails():
    """Base-2 LSE and a finite empty sentinel, declared: the conventions path runs here too."""
    good = run([open_backend(f"tests.planted:{Base2WithSentinel.__name__}")], CI_CASES,
               RunSettings(profile="ci"))
    assert good.failures == [] and {r.status for r in good.results} == {"passed"}
    bad = run([open_backend(f"tests.planted:{SentinelNotConverted.__name__}")], CI_CASES,
              RunSettings(profile="ci", families=("oracle",)))
    caught = [r for r in bad.failures if r.check == "oracle/lse"]
    assert caught and all("empty" in r.case or ",0" in r.case or "[0" in r.case
                          for r in caught)


def test_numpy_backend_passes_every_check_of_the_ci_profile(numpy_report):
    report = numpy_report
    assert report.failures == []
    statuses = {r.status for r in report.results}
    assert statuses == {"passed"}, statuses
    checks = {r.check for r in report.results}
    for expected in ("oracle/output", "oracle/lse", "poison/unwritten", "poison/masked-nan",
                     "purity", "determinism",
                     "merge/segments-page", "merge/segments-inside-page",
                     "merge/segments-empty-segments", "merge/identity", "merge/commutative",
                     "merge/associative", "merge/both-empty", "merge/lse-gap",
                     "invariance/reshuffle", "invariance/wide-table", "invariance/batch-order",
                     "invariance/neighbours", "invariance/gqa-as-mha",
                     "invariance/split-count-3", "invariance/page-size"):
        assert expected in checks


@pytest.mark.parametrize("bug,check", PLANTED, ids=[f"{b.__name__}-{c}" for b, c in PLANTED])
def test_planted_bug_is_caught_by_its_check(bug, check):
    family = check.split("/", 1)[0]
    backend = open_backend(f"tests.planted:{bug.__name__}")
    report = run([backend], CI_CASES, RunSettings(profile="ci", families=(family,)))
    caught = [r for r in report.failures if r.check == check]
    assert caught, f"{bug.__name__} slipped past {check}"
    assert all(r.status == "failed" for r in caught), {r.status for r in caught}
    assert all(r.message and r.reproducer for r in caught)
    # not a fragile catch: two spec families at least see it
    families = {FAMILY_OF[r.case] for r in caught}
    assert len(families) >= 2, f"{bug.__name__} is caught by {check} in {families} only"


def test_a_kernel_that_zeroes_masked_slots_fails_only_the_masked_nan_check():
    """One finding must not blind the suite: with finite garbage in masked slots, a kernel
    that reads them and multiplies by a zero weight is exact everywhere else."""
    backend = open_backend("tests.planted:MasksByZeroWeight")
    report = run([backend], CI_CASES, RunSettings(profile="ci"))
    failing = {r.check for r in report.failures}
    assert failing == {"poison/masked-nan"}, failing


def test_scales_held_from_an_earlier_call_fail_only_the_kv_scale_invariance():
    """A kernel right on every fresh cache, stale when only the scales change: the oracle and
    every re-layout see fresh caches, so ``invariance/kv-scale`` alone can catch it."""
    backend = open_backend("tests.planted:ScaleCompiledIn")
    fp8 = [case for case in CI_CASES if case.kv_dtype is not None]
    report = run([backend], fp8, RunSettings(profile="ci"))
    failing = {r.check for r in report.failures}
    assert failing == {"invariance/kv-scale"}, failing


LARGE_OFFSET = select_cases(default_spec(), "full", ["large-offset"])


@pytest.mark.skipif(LARGE_OFFSET[0].problem_bytes > DEFAULT_MAX_CASE_MIB * 2**20,
                    reason=f"the large-offset case needs about "
                           f"{LARGE_OFFSET[0].problem_bytes / 2**30:.0f} GiB, over half this "
                           f"machine's memory ({DEFAULT_MAX_CASE_MIB / 1024:.0f} GiB): "
                           f"run on a machine with more (the GPU session does)")
def test_flat_offsets_past_2_31_elements_are_caught():
    """A flat offset held in int32 only wraps past 2^31 elements: a full-profile case."""
    settings = RunSettings(profile="full", families=("oracle",))
    bad = run([open_backend("tests.planted:FlatOffsetInInt32")], LARGE_OFFSET, settings)
    assert any(r.check == "oracle/output" and r.status == "failed" for r in bad.results), \
        [(r.check, r.status, r.message) for r in bad.results]
    good = run([open_backend("numpy")], LARGE_OFFSET, settings)
    assert good.failures == [] and {r.status for r in good.results} == {"passed"}
