"""Gating: accuracy drift, strict manifests, expectations update, JUnit and Markdown reports."""

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

ROOT = Path(__file__).resolve().parent.parent
F16_NORMAL = ("-k", "f16/ctx", "-k", "]-normal")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def numpy_baseline(tmp_path_factory):
    """The NumPy backend's errors on the float16 ci cases of normal values, saved as a
    baseline (over the long-flat family a float16 accumulator overflows: a failure, not
    drift)."""
    path = tmp_path_factory.mktemp("acc") / "numpy.json"
    result = cli("run", "--backend", "numpy", "--profile", "ci", *F16_NORMAL, "--check",
                 "oracle", "--save-accuracy", str(path))
    assert result.returncode == 0, result.stdout[-2000:]
    return path


def test_a_worse_accumulator_is_caught_by_drift_and_not_by_the_tolerance(numpy_baseline,
                                                                       tmp_path):
    # the same baseline, as if the backend had changed to accumulate in float16
    data = json.loads(numpy_baseline.read_text())
    data["errors"] = {"bug-half-precision-accumulator": data["errors"]["numpy"]}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(data))
    args = ("run", "--backend", "tests.planted:HalfPrecisionAccumulator", "--profile", "ci",
            *F16_NORMAL, "--check", "oracle")
    plain = cli(*args)
    assert plain.returncode == 0, "the accumulator must stay inside the tolerance"
    report = tmp_path / "r.json"
    gated = cli(*args, "--compare-accuracy", str(baseline), "--report-json", str(report))
    assert gated.returncode == 1
    drifted = [r for r in json.loads(report.read_text())["results"]
               if r["check"].startswith("drift/")]
    assert drifted and all(r["status"] == "failed" for r in drifted)
    assert "accuracy drift: error grew" in gated.stdout


def test_an_unchanged_backend_does_not_drift(numpy_baseline):
    result = cli("run", "--backend", "numpy", "--profile", "ci", "-k", "f16/ctx", "--check",
                 "oracle", "--compare-accuracy", str(numpy_baseline))
    assert result.returncode == 0 and "drift" not in result.stdout


def test_drift_factor_is_configurable(numpy_baseline, tmp_path):
    data = json.loads(numpy_baseline.read_text())
    data["errors"] = {"bug-half-precision-accumulator": data["errors"]["numpy"]}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(data))
    result = cli("run", "--backend", "tests.planted:HalfPrecisionAccumulator", "--profile",
                 "ci", *F16_NORMAL, "--check", "oracle", "--compare-accuracy", str(baseline),
                 "--drift-factor", "1e9")
    assert result.returncode == 0


def test_strict_manifest_fails_on_stale_entries_and_placeholders(tmp_path):
    (tmp_path / "numpy.toml").write_text(
        '[[expect]]\ncase = "no-such/*"\ncheck = "oracle"\nreason = "gone"\n')
    args = ("run", "--backend", "numpy", "--profile", "smoke", "--expectations", str(tmp_path))
    assert cli(*args).returncode == 0
    strict = cli(*args, "--strict-manifest")
    assert strict.returncode == 1 and "numpy.toml:1: entry matches nothing" in strict.stdout


def test_expectations_update_appends_placeholders_that_strict_rejects(tmp_path):
    update = cli("expectations", "update", "--backend", "tests.planted:SinksIgnored",
                 "--profile", "smoke", "--expectations", str(tmp_path))
    assert update.returncode == 0 and "placeholder" in update.stdout
    text = (tmp_path / "bug-sinks-ignored.toml").read_text()
    assert text.count("[[expect]]") == 4 and "TODO" in text
    args = ("run", "--backend", "tests.planted:SinksIgnored", "--profile", "smoke",
            "--expectations", str(tmp_path))
    assert cli(*args).returncode == 0  # the failures are now known
    assert cli(*args, "--strict-manifest").returncode == 1  # until the reasons are written
    (tmp_path / "bug-sinks-ignored.toml").write_text(text.replace(
        "TODO: say why this fails, and link the upstream issue", "sinks are not wired"))
    assert cli(*args, "--strict-manifest").returncode == 0


def test_junit_and_markdown_reports(tmp_path):
    junit, summary, data = tmp_path / "r.xml", tmp_path / "s.md", tmp_path / "r.json"
    result = cli("run", "--backend", "tests.planted:WindowOffByOne", "--profile", "smoke",
                 "--junit-xml", str(junit), "--summary-md", str(summary), "--report-json",
                 str(data))
    assert result.returncode == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("name") == "bug-window-off-by-one"
    failures = suite.findall("testcase/failure")
    assert int(suite.get("failures")) == len(failures) > 0
    assert "rerun: python -m conformance" in failures[0].text
    report = json.loads(data.read_text())
    # every test case carries its share of its case's time; together, the cases' times
    times = [float(case.get("time")) for case in suite.findall("testcase")]
    assert all(t >= 0 for t in times) and any(t > 0 for t in times)
    assert abs(sum(times) - sum(d["seconds"] for d in report["durations"])) < 0.01 * len(times)
    assert abs(float(suite.get("time")) - sum(times)) <= 0.0005 * len(times) + 1e-6  # rounding
    text = summary.read_text()
    assert "**FAIL**" in text and "| backend | oracle |" in text
    reproducers = {f"  `{r['reproducer']}`" for r in report["results"] if r["status"] == "failed"}
    reruns = [line for line in text.splitlines() if line.startswith("  `python -m")]
    assert reruns and set(reruns) <= reproducers  # code spans: copied, each reruns its case
    assert "### Accuracy" in text


def test_compare_gates_an_upgrade_on_what_newly_fails(tmp_path):
    """The 'library upgrade' is the NumPy backend turning into a planted bug: the window
    cases newly fail, the rest is unchanged, and compare exits 1 naming them."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    args = ("run", "--profile", "smoke", "--check", "oracle", "--report-json")
    cli(*args, str(old), "--backend", "numpy")
    upgraded = tmp_path / "upgraded.py"
    upgraded.write_text("from tests.planted import WindowOffByOne\n\n"
                        "class Upgraded(WindowOffByOne):\n    name = 'numpy-next'\n")
    cli(*args, str(new), "--backend", f"{upgraded}:Upgraded")
    data = json.loads(new.read_text())
    for row in data["results"] + data["backends"]:  # the same backend under its new version
        row["backend" if "backend" in row else "name"] = "numpy"
    new.write_text(json.dumps(data))
    result = cli("compare", str(old), str(new))
    assert result.returncode == 1, result.stdout
    newly = [line for line in result.stdout.splitlines() if line.startswith("  numpy")]
    assert newly and all("window" in line and "passed -> failed" in line for line in newly)
    assert "newly passing: 0" in result.stdout
    back = cli("compare", str(new), str(old))
    assert back.returncode == 0 and "newly failing: 0" in back.stdout
    assert f"newly passing: {len(newly)}" in back.stdout


def test_a_baseline_from_another_machine_or_library_version_warns(numpy_baseline, tmp_path):
    data = json.loads(numpy_baseline.read_text())
    assert data["machine"]["libraries"]["numpy"]  # recorded with the baseline
    data["machine"]["libraries"]["numpy"] = "0.0.1"
    data["machine"]["python"] = "2.7.18"
    moved = tmp_path / "elsewhere.json"
    moved.write_text(json.dumps(data))
    result = cli("run", "--backend", "numpy", "--profile", "ci", "-k", "f16/ctx", "--check",
                 "oracle", "--compare-accuracy", str(moved))
    assert result.returncode == 0, result.stdout[-2000:]
    assert "warning: the accuracy baseline" in result.stderr
    assert "numpy: 0.0.1 then" in result.stderr and "python: '2.7.18' then" in result.stderr
    same = cli("run", "--backend", "numpy", "--profile", "ci", "-k", "f16/ctx", "--check",
               "oracle", "--compare-accuracy", str(numpy_baseline))
    assert "warning" not in same.stderr
