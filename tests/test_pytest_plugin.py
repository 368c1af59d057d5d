"""``pytest --conformance-backend NAME --conformance-profile P`` as a user runs it, serially
and under xdist, and beside a project with options of its own."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conformance.spec import default_spec

ROOT = Path(__file__).resolve().parent.parent
SMOKE = len(default_spec().cases("smoke"))  # one test per case and check family (6)


def pytest_run(*args):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    counts = dict((kind, int(n)) for n, kind in re.findall(
        r"(\d+) (passed|failed|skipped|xfailed|deselected|error)", result.stdout))
    return result, counts


def ask(backend, *args, profile="smoke"):
    """pytest with the plugin's backend and profile options, and ``args``."""
    return pytest_run("--conformance-backend", backend, "--conformance-profile", profile, *args)


def test_backend_option_runs_only_conformance_tests_with_case_ids():
    result, counts = ask("numpy", "-rA")
    assert result.returncode == 0, result.stdout[-3000:]
    assert counts["passed"] == SMOKE * 6 and counts.get("deselected", 0) > 0
    assert "numpy/empty-context/q8kv2-d64-ps16-f32/ctx[0,21,40]-normal/poison" in result.stdout


def test_planted_bug_fails_with_error_budget_and_rerun():
    result, counts = ask("tests.planted:Base2Lse", "--conformance-check", "oracle")
    assert result.returncode == 1
    assert counts["failed"] >= 1
    assert "FAILED oracle/lse [error" in result.stdout and "rerun: python -m conformance" in \
        result.stdout


def test_unsupported_cases_are_skipped_with_the_capability_as_reason(tmp_path):
    skeleton = tmp_path / "sk.py"
    subprocess.run([sys.executable, "-m", "conformance", "new-backend", "sk", "--out",
                    str(skeleton)], cwd=ROOT, check=True, capture_output=True)
    # only the conformance template: a test module skipped for a missing package (Triton in
    # `tox -e tests`) would add a skip of its own at collection
    result, counts = ask(f"{skeleton}:SkBackend", "conformance/test_conformance.py", "-rs",
                         "--conformance-allow-empty")
    assert result.returncode == 0
    assert counts["skipped"] == SMOKE * 6 and "passed" not in counts
    assert "unsupported: skeleton: declare capabilities" in result.stdout


def test_a_backend_that_judges_nothing_fails_the_run_unless_allowed(tmp_path):
    # nothing judged is no pass: an unavailable backend, or one claiming none of the selected
    # cases, fails as the CLI refuses it; a backend claiming some still skips the rest
    skeleton = tmp_path / "sk.py"
    subprocess.run([sys.executable, "-m", "conformance", "new-backend", "sk", "--out",
                    str(skeleton)], cwd=ROOT, check=True, capture_output=True)
    for backend, why in ((f"{skeleton}:SkBackend", f"claims none of the {SMOKE} selected cases"),
                         ("flashinfer", "is unavailable here")):
        result, counts = ask(backend, "conformance/test_conformance.py")
        assert result.returncode == 1 and why in result.stdout, result.stdout[-2000:]
        assert counts["failed"] == SMOKE * 6 and "skipped" not in counts
    narrow = tmp_path / "narrow.py"
    narrow.write_text("from conformance.backends.base import Capabilities\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Narrow(NumpySplitK):\n    name = 'narrow'\n"
                      "    capabilities = Capabilities(dtypes={'float32'}, features={'lse'})\n")
    result, counts = ask(f"{narrow}:Narrow", "conformance/test_conformance.py", "-k", "sinks/")
    assert result.returncode == 1 and "claims none of the 3 selected cases" in result.stdout
    result, counts = ask(f"{narrow}:Narrow", "conformance/test_conformance.py", "-k",
                         "empty-context")
    assert result.returncode == 0 and counts["passed"] > 0, result.stdout[-2000:]


def test_known_failures_are_xfailed(tmp_path):
    (tmp_path / "bug-sinks-ignored.toml").write_text(
        '[[expect]]\ncase = "sinks/*+sink*"\ncheck = "oracle/*"\nreason = "sinks not wired"\n')
    result, counts = ask("tests.planted:SinksIgnored", "--conformance-check", "oracle",
                         f"--conformance-expectations={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert counts["xfailed"] == 2 and "failed" not in counts


def test_xdist_gives_the_same_outcomes_as_a_serial_run():
    _, serial_counts = ask("tests.planted:WindowOffByOne")
    _, parallel_counts = ask("tests.planted:WindowOffByOne", "-n", "2")
    serial_counts.pop("deselected", None)  # xdist's controller does not count deselections
    assert serial_counts == parallel_counts and serial_counts["failed"] > 0


def test_bad_options_are_usage_errors():
    result, _ = pytest_run("--conformance-backend", "nope")
    assert result.returncode == 4 and "unknown backend 'nope'" in result.stderr
    result, _ = pytest_run("--conformance-backend", "numpy", "--conformance-profile", "weekly")
    assert result.returncode == 4 and "known: smoke, ci, full" in result.stderr


def test_a_crashing_or_hanging_backend_fails_its_tests_not_the_session():
    result, counts = ask("tests.hostile:Segfaults", "-k", "sinks/", "-p", "no:randomly")
    assert result.returncode == 1, result.stdout[-3000:]
    assert counts["failed"] == 2 * 6 and counts["passed"] == 6
    assert "killed by SIGSEGV" in result.stdout
    result, counts = ask("tests.hostile:HangsInNativeCode", "-k", "sinks/ and oracle",
                         "--conformance-case-timeout", "8")
    assert result.returncode == 1 and counts["failed"] == 2 and counts["passed"] == 1
    assert "timed out after 8 s" in result.stdout


def test_backend_output_is_a_section_of_the_test_report():
    result, _ = ask("tests.hostile:Floods", "-k", "sinks/ and oracle", "-rA")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "backend output" in result.stdout and "LAST LINE OF THE FLOOD" in result.stdout


def test_explore_option_searches_instead_of_listing_cases():
    result, counts = pytest_run("--conformance-backend", "tests.planted:OddKvHeadRemainder",
                                "--conformance-explore", "100")
    assert result.returncode == 1 and counts["failed"] == 1, result.stdout[-3000:]
    assert "num_kv_heads = 3" in result.stdout and "[[family]]" in result.stdout
    result, counts = pytest_run("--conformance-backend", "numpy", "--conformance-explore", "30")
    assert result.returncode == 0 and counts["passed"] == 1, result.stdout[-3000:]


def test_a_project_with_its_own_backend_option_runs_beside_the_plugin(tmp_path):
    # the plugin loads in every pytest run of its environment (its pytest11 entry point, or
    # -p here): a project's own --backend must stay the project's, and the plugin idle
    (tmp_path / "conftest.py").write_text(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--backend', default='cpu')\n\n"
        "def pytest_sessionfinish(session):\n"
        "    idle = not hasattr(session.config, '_conformance')\n"
        "    (session.config.rootpath / 'idle.txt').write_text(str(idle))\n")
    (tmp_path / "test_own.py").write_text(
        "def test_own_option(request):\n"
        "    assert request.config.getoption('backend') == 'gpu'\n")
    from importlib.metadata import entry_points

    registered = any(e.value == "conformance.pytest_plugin"
                     for e in entry_points(group="pytest11"))
    load = [] if registered else ["-p", "conformance.pytest_plugin"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *load, "--backend", "gpu"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "conformance" in subprocess.run(
        [sys.executable, "-m", "pytest", "--help", *load], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout
    assert (tmp_path / "idle.txt").read_text() == "True"
