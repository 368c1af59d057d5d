"""``python -m conformance`` as a user runs it: commands, exit codes, reports, faults."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from conformance.cli import main
from conformance.spec import default_spec
from tests.run_cli import ROOT, cli


def test_backends_lists_numpy_with_capabilities(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "numpy: available" in out
    assert "features: ['lse', 'merge', 'sinks', 'sliding_window', 'split_k']" in out


def test_list_prints_the_profile_ids(capsys):
    assert main(["list", "--profile", "smoke", "-k", "empty-context"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids and all(i.startswith("empty-context/") for i in ids)


def test_run_numpy_passes_and_writes_the_json_report(tmp_path):
    report_path = tmp_path / "report.json"
    result = cli("run", "--backend", "numpy", "--profile", "smoke", "--report-json",
                 str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no unexpected failures" in result.stdout
    assert "numpy" in result.stdout and "oracle" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["schema"] == "paged-decode-conformance/report/1" and report["ok"]
    assert report["backends"][0]["name"] == "numpy"
    row = next(r for r in report["results"] if r["check"] == "oracle/output")
    for key in ("backend", "case", "check", "family", "status", "error", "budget",
                "budget_table", "budget_ratio", "message", "reproducer"):
        assert key in row
    assert row["status"] == "passed" and 0 <= row["error"] <= row["budget"]


def test_durations_lists_the_slowest_cases_and_the_report_holds_every_one(tmp_path):
    report_path = tmp_path / "report.json"
    result = cli("run", "--backend", "numpy", "--profile", "smoke", "-k", "mla/", "--durations",
                 "2", "--report-json", str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    listed = result.stdout.split("slowest 2 case(s):\n", 1)[1].splitlines()[:2]
    seconds = [float(line.split()[0].rstrip("s")) for line in listed]
    assert seconds == sorted(seconds, reverse=True) and all("numpy  mla/" in line
                                                              for line in listed)
    report = json.loads(report_path.read_text())
    timed = {entry["case"]: entry["seconds"] for entry in report["durations"]}
    assert set(timed) == {r["case"] for r in report["results"]}
    assert max(timed.values()) == seconds[0] or abs(max(timed.values()) - seconds[0]) < 0.01
    assert cli("run", "--backend", "numpy", "--durations", "-1").returncode == 2


def test_failures_of_one_cause_print_once_with_the_heads_they_share(tmp_path):
    """A wrong KV-head mapping fails every case alike: one group per check, naming the
    heads that are wrong, by its smallest case; the JSON report keeps every failure."""
    report_path = tmp_path / "report.json"
    result = cli("run", "--backend", "tests.planted:ModuloHeadMapping", "--profile", "smoke",
                 "--check", "oracle", "--report-json", str(report_path))
    assert result.returncode == 1
    failed = [r for r in json.loads(report_path.read_text())["results"]
              if r["status"] == "failed"]
    groups = [line for line in result.stdout.splitlines() if line.startswith("- FAILED")]
    assert len(failed) > 2 * len(groups) >= 4
    assert all("(wrong in heads [1, 3, 4, 6] of 8)" in line for line in groups)
    assert f"{len(failed)} unexpected failure(s) in {len(groups)} group(s)" in result.stdout
    assert {r["wrong_heads"] for r in failed} == {"[1, 3, 4, 6] of 8"}


def test_failures_group_by_the_heads_they_record_not_by_words_in_their_message():
    """A message is for people: a backend's text in it (a note, an exception) that looks
    like a head list must not split or join groups."""
    from conformance.grouping import failure_groups
    from conformance.result import Result

    def failed(case: str, message: str, heads: str) -> Result:
        return Result("oracle/output", "failed", 1.0, 0.1, message=message, backend="b",
                      case=case, wrong_heads=heads)

    groups = failure_groups([failed("a", "error 1 (heads [0] of 8 in a note)", "[1, 3] of 8"),
                             failed("b", "error 2", "[1, 3] of 8"),
                             failed("c", "error 3 heads [1, 3] of 8", "all 8")])
    assert [(g.cause, len(g.results)) for g in groups] == [
        ("wrong in heads [1, 3] of 8", 2), ("wrong in heads all 8", 1)]


def test_a_failure_prints_its_error_and_a_reproducer_that_reruns_it():
    result = cli("run", "--backend", "tests.planted:WindowOffByOne", "--profile", "smoke")
    assert result.returncode == 1
    assert "FAILED bug-window-off-by-one oracle/output [error" in result.stdout
    rerun = next(line.split("rerun: ", 1)[1] for line in result.stdout.splitlines()
                 if "rerun: " in line)
    words = shlex.split(rerun)
    assert words[:3] == ["python", "-m", "conformance"]
    again = cli(*words[3:])
    assert again.returncode == 1
    assert "1 cases" in again.stdout


def test_unknown_backend_and_profile_list_the_valid_ones():
    result = cli("run", "--backend", "nope")
    assert result.returncode == 2 and "unknown backend 'nope'" in result.stderr
    assert "numpy" in result.stderr
    result = cli("run", "--backend", "numpy", "--profile", "nightly")
    assert result.returncode == 2 and "known: smoke, ci, full" in result.stderr
    result = cli("run", "--backend", "numpy", "--check", "speed")
    assert result.returncode == 2 and "oracle" in result.stderr


def test_unavailable_backend_is_refused_with_its_reason():
    result = cli("run", "--backend", "tests.planted:Unavailable", "--profile", "smoke")
    assert result.returncode == 2 and "needs a GPU: none found" in result.stderr


def test_a_backend_that_raises_is_an_error_for_that_case_and_the_run_goes_on(tmp_path):
    report_path = tmp_path / "r.json"
    result = cli("run", "--backend", "tests.planted:RaisesOnWindows", "--profile", "smoke",
                 "--report-json", str(report_path))
    assert result.returncode == 1
    results = json.loads(report_path.read_text())["results"]
    errors = [r for r in results if r["status"] == "error"]
    assert errors and all("window" in r["case"] for r in errors)
    assert all("RuntimeError: kernel launch failed" in r["message"] for r in errors)
    assert any(r["status"] == "passed" and "window" not in r["case"] for r in results)


def test_new_backend_skeleton_runs_and_claims_nothing(tmp_path):
    result = cli("new-backend", "my-kernel", "--out", str(tmp_path / "my_kernel.py"))
    assert result.returncode == 0, result.stderr
    report_path = tmp_path / "r.json"
    target = f"{tmp_path / 'my_kernel.py'}:MyKernelBackend"
    run = cli("run", "--backend", target, "--profile", "smoke", "--report-json", str(report_path))
    # claiming nothing is not a pass: the run fails and says what the backend claims
    assert run.returncode == 1, run.stdout + run.stderr
    assert "my-kernel claims no check of this run" in run.stdout
    statuses = {r["status"] for r in json.loads(report_path.read_text())["results"]}
    assert statuses == {"unsupported"}
    allowed = cli("run", "--backend", target, "--profile", "smoke", "--allow-empty")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    again = cli("new-backend", "my-kernel", "--out", str(tmp_path / "my_kernel.py"))
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.parametrize("name", ["9lives", "has space", ""])
def test_new_backend_rejects_bad_names(tmp_path, name):
    result = cli("new-backend", name, "--out", str(tmp_path / "x.py"))
    assert result.returncode == 2 and "backend name" in result.stderr
    assert not (tmp_path / "x.py").exists()


def test_no_case_matching_is_an_error_not_a_pass():
    result = cli("run", "--backend", "numpy", "-k", "no-such-case")
    assert result.returncode == 2 and "no case matches" in result.stderr


SCHEDULE_FREE = ("created", "command", "machine", "durations")  # may differ between two runs


@pytest.mark.parametrize("backend", ["numpy", "tests.planted:WindowOffByOne"])
def test_the_json_report_is_the_same_however_the_run_is_scheduled(tmp_path, backend):
    # the harness's speed-ups (parallel workers, in-process, what is drawn once and reused)
    # must not change a verdict, an error or a message: the reports agree byte for byte
    # but for when, where and how they were made
    reports = {}
    for name, how in (("isolated-j2", ("-j", "2")), ("in-process", ("--in-process",))):
        path = tmp_path / f"{name}.json"
        cli("run", "--backend", backend, "--profile", "smoke", *how, "--report-json", path)
        report = json.loads(path.read_text())
        for key in SCHEDULE_FREE:
            report.pop(key)
        reports[name] = json.dumps(report, sort_keys=True)
    assert reports["isolated-j2"] == reports["in-process"]
    assert '"status": "passed"' in reports["in-process"]


def test_parallel_run_matches_serial_and_survives_a_crashing_backend(tmp_path):
    serial, parallel = tmp_path / "serial.json", tmp_path / "parallel.json"
    args = ("run", "--backend", "tests.planted:WindowOffByOne", "--profile", "smoke")
    assert cli(*args, "--report-json", str(serial)).returncode == 1
    assert cli(*args, "-j", "2", "--report-json", str(parallel)).returncode == 1

    def outcomes(path):
        return [(r["case"], r["check"], r["status"], r["error"])
                for r in json.loads(path.read_text())["results"]]

    assert outcomes(serial) == outcomes(parallel)

    crashed = tmp_path / "crashed.json"
    result = cli("run", "--backend", "tests.planted:CrashesOnWindows", "--profile", "smoke",
                 "-j", "2", "--report-json", str(crashed))
    assert result.returncode == 1
    results = json.loads(crashed.read_text())["results"]
    errors = [r for r in results if r["status"] == "error"]
    assert errors and all("window" in r["case"] for r in errors)
    assert all("killed by SIGSEGV" in r["message"] or r["message"].startswith("not run")
               for r in errors)
    assert {r["case"] for r in results} == set(
        cli("list", "--profile", "smoke").stdout.split())


@pytest.mark.parametrize("fork", ["1", "0"])
def test_parallel_workers_load_the_backend_once_or_while_its_probe_does(tmp_path, fork):
    """Forked from a zygote, the probe and the -j workers find the backend loaded once.
    Spawned, the workers open it ahead: all three loads (the probe's and two workers') are
    under way at one moment, where they used to follow one another."""
    source, loads = tmp_path / "slow_load.py", tmp_path / "loads.txt"
    source.write_text("import os, time\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "began = time.time()\ntime.sleep(3)\n"
                      "with open(os.environ['LOADS'], 'a') as log:\n"
                      "    log.write(f'{began} {time.time()}\\n')\n\n"
                      "class SlowLoad(NumpySplitK):\n    name = 'slow-load'\n")
    result = cli("run", "--backend", f"{source}:SlowLoad", "-k", "basic/", "-j", "2",
                 env={**os.environ, "LOADS": str(loads), "CONFORMANCE_FORK": fork})
    assert result.returncode == 0, result.stdout + result.stderr
    spans = [tuple(map(float, line.split())) for line in loads.read_text().splitlines()]
    if fork == "1":
        assert len(spans) == 1 and "not forked" not in result.stdout
        return
    assert len(spans) == 3
    assert max(began for began, _ in spans) < min(ended for _, ended in spans)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_terminated_run_still_writes_its_partial_report(tmp_path, jobs):
    import signal

    report = tmp_path / "partial.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "conformance", "run", "--backend", "tests.planted:SlowedDown",
         "--profile", "ci", "-j", jobs, "--report-json", str(report),
         "--summary-md", str(tmp_path / "partial.md")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # progress lines ("done/total cases"): stop after a few
        done = line.split("/", 1)[0]
        if done.isdigit() and int(done) >= 2:
            break
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "INTERRUPTED: interrupted after" in stdout
    assert "interrupted, so it fails" in stdout and "manifest problems" not in stdout
    assert "Interrupted (interrupted after" in (tmp_path / "partial.md").read_text()
    data = json.loads(report.read_text())
    assert data["interrupted"].startswith("interrupted after") and not data["ok"]
    assert 0 < len({r["case"] for r in data["results"]}) < data["cases"]


def test_summary_tabulates_saved_reports_with_their_findings(tmp_path):
    manifests = tmp_path / "expectations"
    manifests.mkdir()
    (manifests / "bug-window-off-by-one.toml").write_text(
        '[[expect]]\ncase = "*window*"\nexcept = ["*window100*"]\ncheck = "oracle"\n'
        'reason = "off by one"\nlink = "docs/findings/off-by-one.md"\n')
    planted, plain = tmp_path / "planted.json", tmp_path / "numpy.json.gz"
    cli("run", "--backend", "tests.planted:WindowOffByOne", "--profile", "smoke", "--check",
        "oracle", f"--expectations={manifests}", "--report-json", str(planted))
    cli("run", "--backend", "numpy", "--profile", "smoke", "--report-json",
        str(tmp_path / "numpy.json"))
    import gzip

    plain.write_bytes(gzip.compress((tmp_path / "numpy.json").read_bytes()))
    result = cli("summary", f"{planted}=laptop", f"{plain}=laptop@numpy")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| backend | machine | profile | cases claimed")
    bug = next(line for line in lines if line.startswith("| bug-window-off-by-one"))
    cells = [c.strip() for c in bug.strip("|").split("|")]
    smoke = str(len(default_spec().cases("smoke")))
    assert cells[1] == "laptop, cpu" and cells[2] == "smoke" and cells[3] == smoke
    assert int(cells[5]) > 0 and cells[7] == "0" and cells[8] == "0"  # known failures only
    assert cells[9] == "[off-by-one](docs/findings/off-by-one.md)"
    assert any(line.startswith(f"| numpy | laptop, cpu | smoke | {smoke} |") for line in lines)
    missing = cli("summary", f"{plain}@nope")
    assert missing.returncode == 2 and "has no backend 'nope'" in missing.stderr


def test_gpu_only_backends_are_unavailable_on_a_cpu_with_their_reason():
    result = cli("backends")
    for name in ("flashinfer", "flashinfer-tc", "flashinfer-prefill"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"{name}:"))
        # no GPU here (or no torch at all, as in `tox -e tests`): unavailable, saying why
        assert line.startswith(f"{name}: unavailable: ") and (
            "needs a CUDA GPU" in line or "not importable" in line), line
    run = cli("run", "--backend", "flashinfer", "--profile", "smoke")
    assert run.returncode == 2 and "is unavailable here:" in run.stderr


def test_run_and_list_default_to_the_ci_profile():
    """`build` defaults to full; once that default leaked into every command through the
    shared --profile option, and `run` without --profile ran the full profile."""
    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    ci = [c.id for c in default_spec().cases("ci")]
    assert listed.stdout.split() == ci


def test_progress_says_the_time_left_and_the_failures_and_fits_the_terminal(monkeypatch):
    import io
    import os

    from conformance import report as report_module

    clock = iter([100.0, 110.0, 120.0, 140.0])
    monkeypatch.setattr(report_module.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    progress = report_module.Progress(stream)  # not a terminal: a line every 10%
    progress(1, 4, "numpy case-a", 0)
    progress(2, 4, "numpy case-b", 3)
    progress(4, 4, "numpy case-d", 3)
    assert stream.getvalue().splitlines() == [
        "1/4 cases, 10.0s, ~30s left, 0 failing", "2/4 cases, 20.0s, ~20s left, 3 failing",
        "4/4 cases, 40.0s, 3 failing"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(report_module.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(report_module.shutil, "get_terminal_size",
                        lambda fallback: os.terminal_size((60, 20)))
    terminal = Terminal()
    report_module.Progress(terminal)(1, 300, "numpy " + "x" * 200, 1)
    line = terminal.getvalue()
    assert line.startswith("\r[") and len(line) == 1 + 59 and "1 failing" in line


def test_python_bytecode_joins_the_caches_only_where_the_libraries_keep_none(tmp_path,
                                                                             monkeypatch):
    """Where the installed libraries' bytecode is not kept beside them (an image installed
    with PYTHONDONTWRITEBYTECODE), every worker would compile torch from source: Python's
    cache goes under the folder, written by the workers; elsewhere, and where the user chose a
    prefix, nothing changes."""
    import importlib.machinery
    import py_compile

    from conformance import caches

    monkeypatch.setattr(os, "environ", dict(os.environ))  # use_cache_dir sets it directly
    for variable in [*caches.CACHE_VARIABLES, "PYTHONPYCACHEPREFIX"]:
        os.environ.pop(variable, None)
    source = tmp_path / "library.py"
    source.write_text("VALUE = 1\n")
    monkeypatch.setattr(caches.importlib.util, "find_spec", lambda name:
                        importlib.machinery.ModuleSpec(name, None, origin=str(source)))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert not caches.libraries_bytecode_kept()
    assert caches.use_cache_dir(tmp_path)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "python")
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "python")
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert "PYTHONPYCACHEPREFIX" not in caches.use_cache_dir(tmp_path)
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "mine")
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    py_compile.compile(str(source))  # now kept beside it, as pip does on install
    assert caches.libraries_bytecode_kept()
    assert "PYTHONPYCACHEPREFIX" not in caches.use_cache_dir(tmp_path)
    assert "PYTHONPYCACHEPREFIX" not in os.environ and os.environ["PYTHONDONTWRITEBYTECODE"] == "1"


def test_compile_caches_live_under_one_folder_that_the_workers_inherit(tmp_path):
    """``--cache-dir``: Triton's, Inductor's and FlashInfer's caches under one folder (one CI
    cache step keeps them all), seen by the backend in its worker process."""
    report = tmp_path / "report.json"
    result = cli("run", "--backend", "tests.hostile:NotesItsCacheDirs", "--profile", "smoke",
                 "--check", "purity", "--cache-dir", tmp_path / "caches", "--report-json",
                 report)
    assert result.returncode == 0, result.stderr
    notes = json.loads(report.read_text())["backends"][0]["notes"]
    assert notes == [f"TRITON_CACHE_DIR={tmp_path / 'caches' / 'triton'}",
                     f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'caches' / 'inductor'}",
                     f"FLASHINFER_WORKSPACE_BASE={tmp_path / 'caches' / 'flashinfer'}"]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    refused = cli("run", "--backend", "numpy", "--profile", "smoke", "--cache-dir",
                  blocked / "caches")
    assert refused.returncode == 2 and "--cache-dir" in refused.stderr
    home = cli("run", "--backend", "tests.hostile:NotesItsCacheDirs", "--profile", "smoke",
               "--check", "purity", "--report-json", report,
               env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                    "TRITON_CACHE_DIR": str(tmp_path / "mine")})
    assert home.returncode == 0, home.stderr
    notes = json.loads(report.read_text())["backends"][0]["notes"]
    assert notes[0] == f"TRITON_CACHE_DIR={tmp_path / 'mine'}"  # the user's own is kept
    assert notes[1] == (f"TORCHINDUCTOR_CACHE_DIR="
                        f"{tmp_path / 'xdg' / 'paged-decode-conformance' / 'inductor'}")
