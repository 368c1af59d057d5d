"""Bad input is exit 2 and one line naming the option or file and the value; reports are
written as the user's files are (their umask, through links, each on its own)."""

from __future__ import annotations

import gzip
import json
import os
import stat
import time
from types import SimpleNamespace

import pytest

from conformance.commands import run as run_command
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import default_spec
from tests.run_cli import cli

CI_CASES = len(select_cases(default_spec(), "ci"))
SMOKE_ONE = ("--backend", "numpy", "--profile", "smoke", "-k", "sinks/", "--check", "oracle")


def refused(result, *fragments):
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr
    assert all(f in result.stderr for f in fragments), result.stderr
    assert "Traceback" not in result.stderr
    return True


@pytest.mark.parametrize("args,what", [
    (("--case-timeout", "3000000"), "at most 1000000, got 3000000"),
    (("--case-timeout", "2147484"), "at most 1000000"),
    (("--case-timeout", "-1"), "must be a number of seconds >= 0"),
    (("--drift-factor", "nan"), "--drift-factor: must be a finite factor >= 1, got nan"),
    (("--drift-factor", "-1"), "must be a finite factor >= 1, got -1"),
    (("--shard", "1/1000000000"), f"1000000000 shards of {CI_CASES} selected cases"),
])
def test_bad_numbers_are_refused_before_the_run(args, what):
    started = time.monotonic()
    assert refused(cli("run", "--backend", "numpy", "--profile", "ci", *args), what)
    assert time.monotonic() - started < 20


def test_bench_refuses_zero_rounds():
    assert refused(cli("bench", "--backend", "numpy", "--rounds", "0"),
                   "--rounds: must be a positive integer, got 0")


@pytest.mark.parametrize("field", ["num_qo_heads = 1000000\nnum_kv_heads = 1",
                                   "num_qo_heads = 4\nnum_kv_heads = 2\ntable_padding = 400000000"])
def test_the_case_size_cap_counts_every_array_a_case_allocates(tmp_path, field):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'schema = 1\n[profiles.p]\ndoc = ""\n[[family]]\nname = "f"\n'
                    f'profiles = ["p"]\n[family.set]\n{field}\nhead_dim = 8\npage_size = 4\n'
                    f'context_lens = [3]\n')
    result = cli("run", "--backend", "numpy", "--spec", spec, "--profile", "p",
                 "--max-case-mib", "1")
    assert refused(result, "over the cap of 1 MiB")


def write_report(tmp_path, name="r.json", *extra):
    path = tmp_path / name
    result = cli("run", *SMOKE_ONE, "--report-json", path, *extra)
    assert result.returncode == 0, result.stdout[-2000:]
    return path


@pytest.mark.parametrize("mangle,what", [
    (lambda r: r.pop("results"), "'results' is a required property"),
    (lambda r: r["results"][0].update(status="fine"), "$.results[0].status"),
    (lambda r: r["backends"][0].pop("name"), "$.backends[0]"),
])
def test_every_reader_refuses_a_report_of_the_wrong_structure(tmp_path, mangle, what):
    report = json.loads(write_report(tmp_path).read_text())
    mangle(report)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(report))
    good = write_report(tmp_path, "good.json")
    for command in (("compare", good, bad), ("summary", bad), ("merge", bad),
                    ("html", "--report-json", bad, "--out", tmp_path / "r.html")):
        assert refused(cli(*command), f"report '{bad}'", what), command
    assert not (tmp_path / "r.html").exists()


def test_a_truncated_gzipped_report_is_one_line(tmp_path):
    whole = gzip.compress(write_report(tmp_path).read_bytes())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert refused(cli("summary", cut), "not a whole gzip file")


def test_an_accuracy_baseline_of_the_wrong_structure_is_refused_before_the_run(tmp_path):
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"schema": "paged-decode-conformance/accuracy/1",
                                    "errors": {"numpy": 3}}))
    report = tmp_path / "r.json"
    result = cli("run", *SMOKE_ONE, "--compare-accuracy", baseline, "--report-json", report)
    assert refused(result, f"accuracy baseline '{baseline}'", "$.errors.numpy")
    assert not report.exists()


@pytest.mark.parametrize("text", ['[[expect]]\ncase = "*"\ncheck = "*"\nreason = "x"\n'
                                  '[expect]\n', 'expect = [1, 2]\n',
                                  '[expect]\ncase = "*"\ncheck = "*"\nreason = "x"\n'])
def test_a_manifest_that_parses_but_is_not_entries_is_refused(tmp_path, text):
    (tmp_path / "numpy.toml").write_text(text)
    assert refused(cli("run", *SMOKE_ONE, f"--expectations={tmp_path}"))


def test_a_manifest_as_one_table_names_the_array_of_tables(tmp_path):
    (tmp_path / "numpy.toml").write_text('[expect]\ncase = "*"\ncheck = "*"\nreason = "x"\n')
    assert refused(cli("run", *SMOKE_ONE, f"--expectations={tmp_path}"),
                   "'expect' must be an array of tables ([[expect]]")


def test_compare_refuses_reports_of_different_runs_unless_told(tmp_path):
    smoke = write_report(tmp_path, "smoke.json")
    other = tmp_path / "ci.json"
    assert cli("run", "--backend", "numpy", "--profile", "ci", "-k", "sinks/", "--check",
               "oracle", "--report-json", other).returncode == 0
    assert refused(cli("compare", other, smoke), "did not run the same thing",
                   "profile 'ci' and 'smoke'", "--allow-different-runs")
    assert cli("compare", other, smoke, "--allow-different-runs").returncode == 0
    assert cli("compare", smoke, smoke).returncode == 0


def test_reports_take_the_users_umask_and_keep_an_existing_mode(tmp_path):
    result = cli("run", *SMOKE_ONE, "--report-json", tmp_path / "new.json",
                 preexec_fn=lambda: os.umask(0o022))
    assert result.returncode == 0
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    kept = tmp_path / "kept.json"
    kept.write_text("")
    kept.chmod(0o640)
    assert cli("run", *SMOKE_ONE, "--report-json", kept).returncode == 0
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and json.loads(kept.read_text())


def test_a_symlinked_report_is_written_through(tmp_path):
    target = tmp_path / "elsewhere" / "report.json"
    target.parent.mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert cli("run", *SMOKE_ONE, "--report-json", link).returncode == 0
    assert link.is_symlink() and json.loads(target.read_text())["results"]


def test_one_path_for_two_reports_is_refused(tmp_path):
    path = tmp_path / "r.out"
    assert refused(cli("run", *SMOKE_ONE, "--report-json", path, "--junit-xml", path),
                   "--junit-xml", "the same file as --report-json")


def test_a_report_that_cannot_be_written_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    backend = open_backend("numpy")
    settings = RunSettings(profile="smoke", families=("oracle",))
    report = run([backend], select_cases(settings.spec(), "smoke")[:1], settings)

    def full_disk(report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_command, "write_junit", full_disk)
    args = SimpleNamespace(report_json=tmp_path / "r.json", junit_xml=tmp_path / "r.xml",
                           summary_md=tmp_path / "r.md", save_accuracy=None)
    assert run_command.write_reports(report, args) is False
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()
    assert "--junit-xml" in capsys.readouterr().err
