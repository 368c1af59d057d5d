"""Expectation manifests: known failures, strict unexpected passes, stale and malformed entries."""

import pytest

from conformance.manifest import ManifestError, load_manifest
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec

WINDOW_CASES = select_cases(default_spec(), "smoke", ["sliding-window", "window20"])


def write(tmp_path, name, text):
    (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


def run_with(tmp_path, backend):
    settings = RunSettings(profile="smoke", families=("oracle",), manifest_dir=tmp_path)
    return run([open_backend(backend, tmp_path)], WINDOW_CASES, settings)


def test_listed_failures_are_known_and_do_not_fail_the_run(tmp_path):
    write(tmp_path, "bug-window-off-by-one", '[[expect]]\ncase = "sliding-window/*"\n'
          'check = "oracle"\nreason = "off by one, tracked upstream"\n')
    report = run_with(tmp_path, "tests.planted:WindowOffByOne")
    known = [r for r in report.results if r.status == "known-failure"]
    assert known and report.ok
    assert all("tracked upstream" in r.message for r in known)


def test_known_failures_are_listed_by_entry_in_every_report(tmp_path):
    import io
    import json

    from conformance.html_report import render
    from conformance.report import report_dict, write_markdown, write_terminal

    write(tmp_path, "bug-window-off-by-one", '[[expect]]\ncase = "sliding-window/*"\n'
          'check = "oracle"\nreason = "off by one, tracked upstream"\n'
          'link = "docs/findings/window.md"\n')
    report = run_with(tmp_path, "tests.planted:WindowOffByOne")
    count = sum(r.status == "known-failure" for r in report.results)
    assert count > 1
    terminal = io.StringIO()
    write_terminal(report, terminal)
    assert (f"- bug-window-off-by-one: {count} x oracle on sliding-window/*: off by one, "
            f"tracked upstream [docs/findings/window.md]") in terminal.getvalue()
    write_markdown(report, tmp_path / "summary.md")
    summary = (tmp_path / "summary.md").read_text()
    assert (f"| bug-window-off-by-one | {count} | oracle | sliding-window/\\* | off by one, "
            f"tracked upstream | docs/findings/window.md |") in summary
    data = json.loads(json.dumps(report_dict(report)))
    assert data["known_failures"] == [{
        "backend": "bug-window-off-by-one", "case": "sliding-window/*", "check": "oracle",
        "reason": "off by one, tracked upstream", "link": "docs/findings/window.md",
        "count": count, "example": next(r.case for r in report.results
                                        if r.status == "known-failure")}]
    page = render(data)
    assert "Known failures (" in page and "docs/findings/window.md" in page


def test_a_listed_case_that_passes_is_an_unexpected_pass_that_fails_the_run(tmp_path):
    write(tmp_path, "numpy", '[[expect]]\ncase = "sliding-window/*window20-*"\n'
          'check = "oracle/output"\nreason = "was broken once"\n')
    report = run_with(tmp_path, "numpy")
    unexpected = [r for r in report.results if r.status == "unexpected-pass"]
    assert unexpected and not report.ok
    message = unexpected[0].message
    assert "remove or narrow the entry" in message and "numpy.toml:1" in message


def test_an_entry_matching_nothing_is_stale(tmp_path):
    write(tmp_path, "numpy", '[[expect]]\ncase = "no-such-family/*"\ncheck = "oracle"\n'
          'reason = "old"\n')
    report = run_with(tmp_path, "numpy")
    report.settings.filtered = False  # staleness is judged on what the run produced
    assert [e.case for _, e in report.stale_expectations()] == ["no-such-family/*"]


@pytest.mark.parametrize("text,fragment", [
    ('[[expect]]\ncase = "x"\ncheck = "oracle"\n', "'reason'"),
    ('[[expect]]\ncase = "x"\ncheck = "oracle"\nreason = "r"\ncolour = 1\n', "'colour'"),
    ('\n\n[[expect]]\ncase = 3\ncheck = "oracle"\nreason = "r"\n', ":3 (entry 1)"),
    ('[expect\n', "not valid TOML"),
    ('name = "x"\n', "unknown top-level"),
])
def test_a_malformed_manifest_fails_at_load_naming_the_place(tmp_path, text, fragment):
    write(tmp_path, "numpy", text)
    with pytest.raises(ManifestError) as error:
        load_manifest("numpy", tmp_path)
    assert fragment in str(error.value) and "numpy.toml" in str(error.value)


def test_the_shipped_manifests_load():
    from conformance.manifest import EXPECTATIONS_DIR
    paths = sorted(EXPECTATIONS_DIR.glob("*.toml"))
    assert paths
    for path in paths:
        manifest = load_manifest(path.stem)
        assert manifest.path == path and manifest.entries, path
        assert all(e.reason.strip() and not manifest.placeholders() for e in manifest.entries)


def test_an_entry_for_another_device_does_not_apply(tmp_path):
    # the NumPy backend runs on the CPU: a cuda-only entry neither excuses nor expects anything
    write(tmp_path, "bug-window-off-by-one", '[[expect]]\ncase = "sliding-window/*"\n'
          'check = "oracle"\ndevice = "cuda"\nreason = "only on GPUs"\n')
    report = run_with(tmp_path, "tests.planted:WindowOffByOne")
    assert not report.ok and not [r for r in report.results if r.status == "known-failure"]
    write(tmp_path, "bug-window-off-by-one", '[[expect]]\ncase = "sliding-window/*"\n'
          'check = "oracle"\ndevice = "cpu"\nreason = "on CPUs"\n')
    report = run_with(tmp_path, "tests.planted:WindowOffByOne")
    assert report.ok and [r for r in report.results if r.status == "known-failure"]


def test_except_leaves_cases_out_of_an_entry(tmp_path):
    # window20 is the one window case the off-by-one bug fails on in this selection
    write(tmp_path, "bug-window-off-by-one", '[[expect]]\ncase = "sliding-window/*"\n'
          'except = ["*window20*"]\ncheck = "oracle"\nreason = "off by one"\n')
    report = run_with(tmp_path, "tests.planted:WindowOffByOne")
    failed = {r.case for r in report.results if r.status == "failed"}
    assert failed and all("window20" in case for case in failed)


@pytest.mark.parametrize("field,message", [
    ('device = "tpu"', "field 'device' must be one of cpu, cuda"),
    ('except = "*x*"', "field 'except' must be a list of case patterns"),
])
def test_bad_device_or_except_fields_are_refused(tmp_path, field, message):
    write(tmp_path, "numpy", f'[[expect]]\ncase = "*"\ncheck = "oracle"\nreason = "r"\n{field}\n')
    with pytest.raises(ManifestError, match=message):
        load_manifest("numpy", tmp_path)
